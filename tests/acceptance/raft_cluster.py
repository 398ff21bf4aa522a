"""Three Raft nodes on loopback for acceptance tests, optionally behind the partition proxy.

Node i listens on (and connects from) ``127.0.0.(10+i)``. Behind the proxy
(:mod:`durable.testing.raftproxy`) it advertises a proxy address (``--raft-self``) and
binds its own (``--raft-bind``), so a test can cut its Raft links while its database
connections stay up. Every node runs durable's default settings plus ``DURABLE["RAFT"]``
(the test project reads it as JSON from ``DURABLE_RAFT``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import connection

from durable.models import ShardLease, Timer, WorkerNode
from durable.testing.nodes import Worker, raft_unavailable_reason
from durable.testing.raftproxy import ProxiedNode, RaftProxy, loopback_nodes
from tests.acceptance.helpers import WorkerPool, database_url, fired_count, progress

PASSWORD = "acceptance-raft-password"  # a throwaway cluster on loopback only


def at(ms: int) -> datetime:
    """Epoch ms as the aware datetime ``durable.schedule_many`` takes."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def check_timing(what: str, value_ms: float, limit_ms: float) -> None:
    """Assert one of issue 17's Raft timing targets (2 s failover, 1 s rolling restart).

    A miss fails, naming the figure and the load. Until 2026-12-07 a miss was an expected
    failure (the targets did not hold on the 2-core machine); since the graceful hand-off
    and the election fix every run met them with room (SIGKILL 0.9 s, SIGSTOP 0.9 s,
    partition 1.0 s, rolling restart 0.3 s). ``DURABLE_RAFT_TIMING=report`` turns a miss
    back into an expected failure, for a machine known to be overloaded.
    """
    if value_ms <= limit_ms:
        return
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    message = f"{what}: {value_ms:.0f} ms > {limit_ms:.0f} ms (load {load:.1f}/{cores})"
    if os.environ.get("DURABLE_RAFT_TIMING") == "report":
        pytest.xfail(f"issue 17 target missed on this machine: {message}")
    raise AssertionError(message)


def skip_without_raft() -> None:
    """Skip the test, naming what is missing, when the worker cannot run Raft here."""
    if connection.vendor != "postgresql":
        pytest.skip("Raft acceptance tests run on PostgreSQL")
    reason = raft_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Raft not runnable in this checkout: {reason}")


@contextmanager
def raft_cluster(
    log_dir: Path, shards: int, *, proxied: bool
) -> Iterator[tuple[WorkerPool, list[ProxiedNode], RaftProxy | None]]:
    """Three started nodes ``n1..n3`` (and the running proxy when ``proxied``)."""
    nodes = loopback_nodes(3, shards)
    advertised = [node.advertised if proxied else node.bind for node in nodes]
    raft = {"SELF": advertised[0], "PEERS": advertised[1:], "PASSWORD": PASSWORD}
    pool = WorkerPool(
        database_url=database_url(connection.settings_dict),
        log_dir=log_dir,
        defaults=True,
        env={"DURABLE_RAFT": json.dumps(raft)},
    )
    proxy = RaftProxy(nodes, ports=shards).start() if proxied else None
    try:
        for node, address in zip(nodes, advertised, strict=True):
            args = ["--raft-self", address]
            if proxied:
                args += ["--raft-bind", node.bind]
            pool.start(node.name, *args)
        yield pool, nodes, proxy
    finally:
        try:
            pool.stop_all()
        finally:
            if proxy is not None:
                proxy.close()


def held() -> dict[str, dict[int, int]]:
    """Owner → {shard: token} of every lease row with an owner."""
    out: dict[str, dict[int, int]] = {}
    for shard, owner, token in ShardLease.objects.exclude(owner="").values_list(
        "shard", "owner", "token"
    ):
        out.setdefault(owner, {})[shard] = token
    return out


def spread_over(names: list[str], shards: int) -> bool:
    """True when every shard has an owner and every node in ``names`` holds some."""
    owners = held()
    return sum(map(len, owners.values())) == shards and set(names) <= set(owners)


def wait_all_fired(
    pool: WorkerPool, prefix: str, count: int, names: list[str], timeout_s: float = 90
) -> None:
    """Wait until ``count`` records of ``prefix`` exist and nothing is pending."""
    pool.wait_until(
        lambda: fired_count(prefix) >= count and not Timer.objects.filter(state="pending").exists(),
        timeout_s=timeout_s,
        what=f"all {count} {prefix!r} timers fired",
        require_alive=names,
        explain=lambda: progress(prefix),
    )


def raft_views(names: list[str]) -> dict[str, dict[int, dict[str, object]]]:
    """Node → {shard: {role, term, leader}} as its last heartbeat published it."""
    rows = WorkerNode.objects.filter(name__in=names).values_list("name", "raft")
    return {name: {int(s): v for s, v in (view or {}).items()} for name, view in rows}


def led_by_owners(pool: WorkerPool, shards: int) -> bool:
    """Every shard held by a running node that (by its last heartbeat) leads it."""
    alive = pool.alive()
    views = raft_views(alive)
    rows = list(ShardLease.objects.values_list("shard", "owner"))
    return len(rows) == shards and all(
        owner in alive and views.get(owner, {}).get(shard, {}).get("role") == "leader"
        for shard, owner in rows
    )


def acquired_at_ms(worker: Worker) -> dict[tuple[int, int], int]:
    """``(shard, token)`` → epoch ms of each lease ``worker`` took, from its log.

    ``lease.acquired`` (a free lease), ``lease.takeover`` (an expired one) and
    ``lease.raft_takeover`` (taken at once as the shard's Raft leader).
    """
    out = {}
    for name in ("lease.acquired", "lease.takeover", "lease.raft_takeover"):
        for line in worker.events(name):
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")  # local, as logged
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            out[(int(fields["shard"]), int(fields["token"]))] = int(stamp.timestamp() * 1000)
    return out
