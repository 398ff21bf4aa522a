"""Three real workers on the benchmark database, leases only or Raft on (``bench/failover.py``).

Built on :class:`durable.testing.nodes.WorkerPool`. With Raft on, node i listens on (and
connects from) ``127.0.0.(10+i)``, base port 7100 (shard s on 7100 + s), with
``DURABLE["RAFT"]`` as JSON in ``DURABLE_RAFT`` (read by the test project's settings).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench._common import REPO, connect
from durable.testing.nodes import WorkerPool

NODES = ("f1", "f2", "f3")
#: Several people may bench on one machine at once: each can move the ports
#: (``BENCH_RAFT_PORT``, ``BENCH_METRICS_PORT``) into a range of their own.
RAFT_BASE_PORT = int(os.environ.get("BENCH_RAFT_PORT", "7100"))
#: Node i serves Prometheus /metrics on this port + i (loopback).
METRICS_BASE_PORT = int(os.environ.get("BENCH_METRICS_PORT", "9710"))
#: Only ever a benchmark's throwaway cluster on loopback.
RAFT_PASSWORD = "bench-failover-password"


@dataclass(frozen=True)
class Mode:
    """One column of the comparison."""

    key: str
    label: str
    ttl_s: float
    #: None: Raft off; else extra ``DURABLE["RAFT"]`` keys (tuning; {} for the defaults).
    raft: dict[str, object] | None
    #: Extra settings (environment of the test project's settings) every node runs with.
    env: dict[str, str] = field(default_factory=dict)


def node_env(mode: Mode) -> tuple[str, dict[str, str]]:
    """The settings module and environment every node of ``mode`` shares."""
    env = {
        "DJANGO_DEBUG": "false",  # DEBUG keeps every query in memory
        "DURABLE_LEASE_TTL_S": str(mode.ttl_s),
        "DURABLE_IMPORTS": "bench.peers.durable_side,tests.acceptance.workflows",
        **mode.env,
    }
    if mode.raft is not None:
        peers = [raft_address(name) for name in NODES]
        raft = {"SELF": peers[0], "PEERS": peers[1:], "PASSWORD": RAFT_PASSWORD, **mode.raft}
        env["DURABLE_RAFT"] = json.dumps(raft)
    return "testproject.settings", env


def raft_address(name: str) -> str:
    """Node ``name``'s Raft base address: its own loopback IP, so links can be told apart."""
    return f"127.0.0.{10 + NODES.index(name) + 1}:{RAFT_BASE_PORT}"


@contextlib.contextmanager
def cluster(url: str, mode: Mode, log_dir: Path) -> Iterator[WorkerPool]:
    """Three started workers of ``mode``; every one stopped at the end, whatever happens."""
    settings_module, env = node_env(mode)
    pool = WorkerPool(
        database_url=url, log_dir=log_dir, cwd=REPO, settings_module=settings_module, env=env
    )
    try:
        for i, name in enumerate(NODES):
            args = ["--metrics-port", str(METRICS_BASE_PORT + i)]
            if mode.raft is not None:
                args += ["--raft-self", raft_address(name)]
            pool.start(name, *args)
        yield pool
    finally:
        pool.stop_all()


def owners(url: str) -> dict[str, dict[int, int]]:
    """Live owner → {shard: token} of every unexpired lease."""
    with connect(url) as conn:
        rows = conn.execute(
            "SELECT owner, shard, token FROM durable_shardlease"
            " WHERE owner <> '' AND expires_at > now()"
        ).fetchall()
    held: dict[str, dict[int, int]] = {}
    for owner, shard, token in rows:
        held.setdefault(owner, {})[shard] = token
    return held


def loaded_shards(pool: WorkerPool) -> int:
    """``shard.loaded`` events logged by the running workers (each shard's first load)."""
    return sum(len(w.events("shard.loaded")) for w in pool.workers.values() if w.alive)


def wait_spread(url: str, pool: WorkerPool, shards: int, timeout_s: float = 180) -> float:
    """Wait until the three nodes hold every shard between them, loaded, for 2 s running.

    "For 2 s running": the same owners and tokens, so a cluster whose leases keep lapsing
    (a TTL shorter than a node's load of its shards) is not taken for a settled one.
    """
    last: list[object] = [None, 0.0]

    def ready() -> bool:
        held = owners(url)
        settled = (
            sum(map(len, held.values())) == shards
            and set(held) == set(NODES)
            and loaded_shards(pool) >= shards
        )
        if not settled or held != last[0]:
            last[:] = [held if settled else None, time.monotonic()]
            return False
        return time.monotonic() - float(last[1]) >= 2.0  # type: ignore[arg-type]

    return pool.wait_until(
        ready,
        timeout_s=timeout_s,
        what="3 nodes holding and loading every shard, unchanged for 2 s",
        require_alive=NODES,
        interval_s=0.2,
    )


def rss_mb(pool: WorkerPool) -> dict[str, float]:
    """Resident memory of each running node, MB (``VmRSS`` of ``/proc``: Linux only)."""
    out = {}
    for name, w in pool.workers.items():
        if w.alive:
            status = Path(f"/proc/{w.pid}/status").read_text()
            out[name] = int(status.split("VmRSS:")[1].split()[0]) / 1024
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (fields 14 and 15 of ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_percent(pool: WorkerPool, seconds: float) -> dict[str, float]:
    """Each node's CPU use over ``seconds`` (100 = one core)."""
    pids = {name: w.pid for name, w in pool.workers.items() if w.alive}
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    started = time.monotonic()
    time.sleep(seconds)
    took = time.monotonic() - started
    return {name: 100 * (_cpu_s(pid) - before[name]) / took for name, pid in pids.items()}


class LagWatch:
    """Scrapes every node's ``durable_raft_replication_lag_seconds`` twice a second."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LagWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for i, name in enumerate(NODES):
                if not self.pool.workers[name].alive:
                    continue
                url = f"http://127.0.0.1:{METRICS_BASE_PORT + i}/metrics"
                try:
                    text = urllib.request.urlopen(url, timeout=2).read().decode()
                except OSError:
                    continue
                self.samples += [
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("durable_raft_replication_lag_seconds{")
                ]


def raft_events(pool: WorkerPool, pattern: str) -> int:
    """Log lines of every node matching ``pattern`` (e.g. leadership changes)."""
    rx = re.compile(pattern)
    return sum(1 for w in pool.workers.values() for line in w.log().splitlines() if rx.search(line))
