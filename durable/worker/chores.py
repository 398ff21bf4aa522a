"""The engine's periodic chores besides firing: clock offset, gauges, retention.

Each chore has its own period. The clock offset is measured on the loop before a turn
fires (so fires use the fresh offset); retention pruning runs on the loop between turns,
after the fires, in small bounded batches, never inside a firing transaction; the
database reads of the gauges run on a pool thread (counting millions of pending rows
takes a while). Pruning stays on the loop because a pass racing the fires of the same
turn made the worker's behaviour depend on thread timing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from django.db import DatabaseError

from durable.conf import DurableSettings
from durable.core.clock import Clock
from durable.metrics import WorkerMetrics
from durable.storage import status as status_store
from durable.worker import housekeeping
from durable.worker.logs import event
from durable.worker.pool import HandlerPool, tidy_connections
from durable.worker.runner import ShardRunner

log = logging.getLogger("durable.worker")

PRUNE_EVERY_MS = 60_000
OFFSET_EVERY_MS = 60_000
SAMPLE_EVERY_MS = 15_000
SAMPLE_DB_EVERY_MS = 60_000


class Chores:
    """Runs the chores that are due; the engine calls it each turn."""

    def __init__(
        self,
        *,
        db: str,
        conf: DurableSettings,
        node: str,
        clock: Clock,
        pool: HandlerPool,
        metrics: WorkerMetrics,
        runners: Callable[[], Mapping[int, ShardRunner]],
    ) -> None:
        self.db = db
        self.conf = conf
        self.node = node
        self.clock = clock
        self.pool = pool
        self.metrics = metrics
        self.runners = runners
        self._next_offset_ms = 0
        self._next_sample_ms = 0
        self._next_db_sample_ms = 0
        self._next_prune_ms = 0

    def before_firing(self, now: int) -> None:
        """Measure the clock offset when due (the worker fires by database time)."""
        if now >= self._next_offset_ms:
            self.measure_offset()

    def measure_offset(self) -> None:
        """Measure the offset now (``housekeeping.measure_offset``); the next in a minute."""
        self._next_offset_ms = self.clock.now_ms() + OFFSET_EVERY_MS
        housekeeping.measure_offset(self.clock, self.db)

    def after_firing(self, now: int) -> None:
        """Prune (between turns, after the fires) and sample the gauges when due."""
        if now >= self._next_prune_ms:
            self._next_prune_ms = now + PRUNE_EVERY_MS
            self.prune(now)
        if now >= self._next_sample_ms:
            self.sample(now)

    def prune(self, now: int) -> int:
        """One pruning pass, on the calling thread; return the rows deleted."""
        return housekeeping.prune(self.db, self.conf, now, self.node)

    def sample(self, now: int) -> None:
        """Refresh the gauges: wheel depth per shard and level, pending rows per shard."""
        self._next_sample_ms = now + SAMPLE_EVERY_MS
        runners = self.runners()
        depths = {}
        for shard, runner in runners.items():
            wheel = runner.wheel
            depths[shard] = (*wheel.pending_per_level(), wheel.pending_overflow())
        self.metrics.set_wheel_depths(depths)
        if now >= self._next_db_sample_ms:
            # Counting millions of pending rows takes a while: never on the fire loop.
            self._next_db_sample_ms = now + SAMPLE_DB_EVERY_MS
            self.pool.submit(self.sample_database, sorted(runners))

    def sample_database(self, shards: list[int]) -> None:
        """Refresh the gauges read from the database (pending rows per shard, runs by state)."""
        try:
            counts = status_store.pending_by_shard(self.db)
            self.metrics.set_db_pending({s: counts.get(s, 0) for s in shards})
            self.metrics.set_workflow_runs(status_store.workflow_runs_by_state(self.db))
        except DatabaseError as exc:
            event(log, logging.WARNING, "metrics.sample_failed", error=exc)
        finally:
            tidy_connections()
