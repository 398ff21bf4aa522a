"""Real ``manage.py run_timer_shards`` subprocesses: start, watch RSS, SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from bench._common import REPO, connect


class WorkerProcess:
    """One ``run_timer_shards`` process on the benchmark database."""

    def __init__(self, url: str, node: str, **env: str) -> None:
        self.url = url
        self.node = node
        self.log = open(f"/tmp/bench-timers-{node}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "run_timer_shards", "--node", node],
            cwd=REPO,
            env={
                **os.environ,
                "DATABASE_URL": url,
                "DJANGO_DEBUG": "false",  # DEBUG keeps every query in memory
                "DURABLE_LOG_LEVEL": "INFO",
                # The worker runs only what it registered at start-up: the bench handlers.
                "DURABLE_IMPORTS": "bench.peers.durable_side,bench.peers.cron_side",
                **env,
            },
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.proc.pid

    def owned(self) -> int:
        """How many leases this node holds now."""
        with connect(self.url) as conn:
            return int(
                conn.execute(
                    "SELECT count(*) FROM durable_shardlease"
                    " WHERE owner = %s AND expires_at > now()",
                    [self.node],
                ).fetchone()[0]
            )

    def wait_owning(self, shards: int, timeout_s: float = 60) -> float:
        """Wait until it holds ``shards`` leases; return the seconds waited."""
        started = time.monotonic()
        while self.owned() < shards:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.node} exited: see {self.log.name}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"worker {self.node} holds {self.owned()}/{shards} shards")
            time.sleep(0.05)
        return time.monotonic() - started

    def rss_mb(self) -> float:
        """Resident set size in MB (psutil)."""
        import psutil

        return psutil.Process(self.pid).memory_info().rss / 2**20

    def settled_rss_mb(self, quiet_s: float = 3.0, timeout_s: float = 120.0) -> float:
        """RSS once it stopped moving by more than 1 MB for ``quiet_s``."""
        deadline = time.monotonic() + timeout_s
        last, since = self.rss_mb(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.rss_mb()
            if abs(now - last) > 1.0:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return now
        return self.rss_mb()

    def kill(self) -> None:
        """SIGKILL: no lease release, no clean-up."""
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM and wait (releases leases); SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
