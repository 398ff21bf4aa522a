"""The nemesis: applies faults to the workers and the database at seeded random times.

Kinds (:data:`KINDS`):

- ``kill``: SIGKILL a worker, restart it 2-8 s later;
- ``stop``: SIGSTOP a worker for 1-15 s, then SIGCONT (longer than ``LEASE_TTL_S``
  sometimes, so its shards are taken over and its late commits must be fenced);
- ``terminate``: ``pg_terminate_backend`` on about half the workers' sessions;
- ``listen``: terminate the workers' LISTEN sessions (NOTIFYs sent meanwhile are lost);
- ``lock``: a transaction holds ``FOR UPDATE`` locks on some shards' lease rows and their
  pending timers for 1-5 s (a slow database);
- ``pg_restart``: restart the PostgreSQL server, only when the run owns a throwaway
  cluster (``--pg-restart``): the shared server is never restarted;
- ``partition`` and ``delay``, only with Raft on (``--raft``, :mod:`chaos.raft`): cut a
  worker's Raft links for 1-10 s (it keeps its database sessions), or delay every byte
  they carry by 50-500 ms for 2-10 s, through the run's proxy.

Now and then two or three kinds strike together. The nemesis never kills or stops the
last worker that is up (a restarted one counts only once it has booted): the run
measures recovery, not an empty cluster. Poison work may still take one down.
Every fault is appended to a JSONL log (kind, start and end in epoch ms, targets), which
the checker reads to attribute lateness.
"""

from __future__ import annotations

import heapq
import json
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import IO, Any

KINDS = ("kill", "stop", "terminate", "listen", "lock")
RAFT_KINDS = ("partition", "delay")
WORKER_APP_PREFIX = "durable-worker-"


def wall_ms() -> int:
    """Epoch ms by this machine's clock."""
    return time.time_ns() // 1_000_000


class Nemesis:
    """Applies faults through ``pool`` (a :class:`tests.acceptance.helpers.WorkerPool`)."""

    def __init__(
        self,
        *,
        pool: Any,
        names: list[str],
        seed: int,
        dsn: str,
        log: IO[str],
        kinds: tuple[str, ...] = KINDS,
        mean_interval_s: float = 5.0,
        restart_db: Callable[[float], None] | None = None,
        raft: Any = None,
    ) -> None:
        self.pool = pool
        self.names = names
        self.rng = random.Random(seed ^ 0x5EED)
        self.dsn = dsn
        self.log = log
        self.kinds = kinds + (("pg_restart",) if restart_db else ())
        self.kinds += RAFT_KINDS if raft is not None else ()
        self.raft = raft  # chaos.raft.RaftSetup: its proxy carries every Raft link
        self.raft_faults: set[tuple[str, str]] = set()  # (kind, node) cut or delayed now
        self.mean = mean_interval_s
        self.restart_db = restart_db
        self.impaired: set[str] = set()  # killed or stopped, not yet healed
        self.booted: set[str] = set(names)  # the orchestrator waited for the first boot
        self.log_offset: dict[str, int] = {}
        self.heals: list[tuple[float, int, Callable[[], None]]] = []
        self.n = 0
        self.next_at = time.monotonic() + self.rng.expovariate(1 / self.mean)
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    # -- bookkeeping ------------------------------------------------------------------------

    def record(self, **fields: Any) -> None:
        with self.lock:
            self.log.write(json.dumps(fields, separators=(",", ":")) + "\n")
            self.log.flush()

    def later(self, seconds: float, action: Callable[[], None]) -> None:
        self.n += 1
        heapq.heappush(self.heals, (time.monotonic() + seconds, self.n, action))

    def healthy(self) -> list[str]:
        """Workers up and serving: alive, not frozen, and started (past their boot)."""
        return [
            n
            for n in self.names
            if n not in self.impaired and self.pool.workers[n].alive and self.started(n)
        ]

    def started(self, name: str) -> bool:
        """True once the worker's current process logged ``worker.started`` (a restarted
        one takes seconds to boot: until then it serves nothing)."""
        if name in self.booted:
            return True
        worker = self.pool.workers[name]
        with worker.log_path.open("rb") as log:
            log.seek(self.log_offset.get(name, 0))
            if b" worker.started " in log.read():
                self.booted.add(name)
                return True
        return False

    def restart(self, name: str) -> None:
        """Start ``name`` again; it counts as impaired until it has booted."""
        self.log_offset[name] = self.pool.workers[name].log_path.stat().st_size
        self.booted.discard(name)
        self.pool.restart(name)  # with its options (a Raft node's addresses)
        self.impaired.discard(name)
        self.record(kind="restart", start_ms=wall_ms(), target=name)

    # -- the loop -------------------------------------------------------------------------

    def tick(self) -> None:
        """Heal what is due and, when its time has come, strike."""
        while self.heals and self.heals[0][0] <= time.monotonic():
            heapq.heappop(self.heals)[2]()
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self.rng.expovariate(1 / self.mean)
        how_many = 1 if self.rng.random() < 0.75 else self.rng.randint(2, 3)
        for kind in self.rng.sample(self.kinds, min(how_many, len(self.kinds))):
            getattr(self, f"do_{kind}")()

    def heal_all(self) -> None:
        """Apply every pending heal now (restart, SIGCONT) and wait for lock holders."""
        while self.heals:
            heapq.heappop(self.heals)[2]()
        for thread in self.threads:
            thread.join(timeout=30)

    # -- faults -----------------------------------------------------------------------------

    def pick_worker(self) -> str | None:
        healthy = self.healthy()
        if len(healthy) <= 1:
            return None  # keep one worker up
        return self.rng.choice(healthy)

    def do_kill(self) -> None:
        name = self.pick_worker()
        if name is None:
            return
        self.impaired.add(name)
        start = wall_ms()
        self.pool.workers[name].kill()
        down_s = self.rng.uniform(2, 8)
        self.record(kind="kill", start_ms=start, end_ms=start, target=name, down_s=down_s)

        self.later(down_s, lambda: self.restart(name))

    def do_stop(self) -> None:
        name = self.pick_worker()
        if name is None:
            return
        self.impaired.add(name)
        start = wall_ms()
        self.pool.workers[name].send(signal.SIGSTOP)
        frozen_s = self.rng.uniform(1, 15)

        def resume() -> None:
            self.pool.workers[name].send(signal.SIGCONT)
            self.impaired.discard(name)
            self.record(kind="stop", start_ms=start, end_ms=wall_ms(), target=name)

        self.later(frozen_s, resume)

    def _terminate(self, kind: str, where: str, share: float) -> None:
        import psycopg

        start = wall_ms()
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity "
                f"WHERE datname = current_database() AND application_name LIKE %s {where} "
                "AND pid <> pg_backend_pid()",
                [WORKER_APP_PREFIX + "%"],
            ).fetchall()
            chosen = [r for r in rows if self.rng.random() < share]
            for pid, _ in chosen:
                conn.execute("SELECT pg_terminate_backend(%s)", [pid])
        targets = sorted({app.removeprefix(WORKER_APP_PREFIX) for _, app in chosen})
        self.record(kind=kind, start_ms=start, end_ms=wall_ms(), target=targets, n=len(chosen))

    def do_terminate(self) -> None:
        self._terminate("terminate", "", 0.5)

    def do_listen(self) -> None:
        self._terminate("listen", "AND query ILIKE 'LISTEN%%'", 1.0)

    def do_lock(self) -> None:
        shards = self.rng.sample(range(64), self.rng.randint(1, 8))
        hold_s = self.rng.uniform(1, 5)
        thread = threading.Thread(target=self._hold_locks, args=(shards, hold_s), daemon=True)
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]
        thread.start()

    def _hold_locks(self, shards: list[int], hold_s: float) -> None:
        import psycopg

        start = wall_ms()
        try:
            with psycopg.connect(self.dsn, connect_timeout=5) as conn:
                conn.execute(
                    "SELECT shard FROM durable_shardlease WHERE shard = ANY(%s) FOR UPDATE",
                    [shards],
                )
                conn.execute(
                    "SELECT id FROM durable_timer WHERE shard = ANY(%s) AND state = 'pending' "
                    "FOR UPDATE",
                    [shards],
                )
                time.sleep(hold_s)
                conn.rollback()
        except psycopg.Error as exc:
            self.record(kind="lock_error", start_ms=start, error=str(exc)[:200])
            return
        self.record(kind="lock", start_ms=start, end_ms=wall_ms(), target=shards)

    def do_pg_restart(self) -> None:
        assert self.restart_db is not None
        start = wall_ms()
        pause_s = self.rng.uniform(0.5, 3)
        self.restart_db(pause_s)
        self.record(kind="pg_restart", start_ms=start, end_ms=wall_ms(), down_s=pause_s)

    def do_partition(self) -> None:
        self._raft_fault("partition")

    def do_delay(self) -> None:
        self._raft_fault("delay")

    def _raft_fault(self, kind: str) -> None:
        from chaos.raft import fault_window

        free = [n for n in self.names if (kind, n) not in self.raft_faults]
        if not free:
            return  # each node has one of this kind already (a heal would end both)
        name = self.rng.choice(free)
        self.raft_faults.add((kind, name))
        lasts_s, delay_s = fault_window(self.rng, kind)
        proxy = self.raft.proxy
        start = wall_ms()
        if kind == "partition":
            proxy.cut(name)
        else:
            proxy.delay(name, delay_s)

        def heal() -> None:
            if kind == "partition":
                proxy.restore(name)
            else:
                proxy.delay(name, 0)
            self.raft_faults.discard((kind, name))
            self.record(kind=kind, start_ms=start, end_ms=wall_ms(), target=name, delay_s=delay_s)

        self.later(lasts_s, heal)

    def watch_crashes(self) -> None:
        """A worker that died on its own (poison ``os._exit``) is logged and restarted."""
        for name in self.names:
            worker = self.pool.workers[name]
            if name not in self.impaired and not worker.alive:
                self.impaired.add(name)
                code = worker.proc.returncode
                self.record(
                    kind="crash", start_ms=wall_ms(), end_ms=wall_ms(), target=name, code=code
                )
                self.later(1.0, lambda name=name: self.restart(name))
