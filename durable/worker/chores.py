"""The engine's periodic chores besides firing: clock offset, gauges, retention.

Each chore has its own period. The clock offset is measured on the loop before a turn
fires (so fires use the fresh offset); retention pruning runs on the loop between turns,
after the fires, in small batches paced to the rate rows pass retention (one short
batch at a time, not bursts of large ones), never inside a firing transaction; the
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

#: The pruning pass: failed timers and finished runs, and the fired timers' batch that
#: starts the paced batches (:meth:`Chores._follow_up`) when there are some.
PRUNE_EVERY_MS = 60_000
#: Paced batches of fired timers, between turns: each comes back when about this many
#: rows have passed retention since the last (from the rate the last batch found), at
#: most ``housekeeping.TIMER_BATCH``, so the loop is held one short batch at a time
#: and fires never queue behind a burst of large ones.
PRUNE_TARGET_ROWS = 100
#: The shortest spacing of paced batches: after a full one (rows are waiting), the next
#: comes this soon; up to ``TIMER_BATCH`` rows every 20 ms per worker (10,000 a second,
#: as the bursts of 1,000 every 100 ms before, if the database keeps up).
PRUNE_STEP_MS = 20
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
        self._next_batch_ms: int | None = None  # the next paced batch; None: none to pace
        self._last_batch_ms: int | None = None  # when the last batch of fired timers ran
        self._pruned_rows = 0  # fired timers deleted since the last log line

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
        elif self._next_batch_ms is not None and now >= self._next_batch_ms:
            self.prune_more(now)
        if now >= self._next_sample_ms:
            self.sample(now)

    def prune(self, now: int) -> int:
        """One pruning pass, on the calling thread; return the rows deleted.

        Fired timers deleted in it start the paced batches (:meth:`prune_more`).
        """
        self._log_pruned()  # what the paced batches deleted since the last pass
        timers = housekeeping.prune_timers(self.db, self.conf, now)
        self._follow_up(now, timers)
        return timers + housekeeping.prune(self.db, self.conf, now, self.node, timers=False)

    def next_due_ms(self) -> int:
        """When the chores next have pruning to do (the engine wakes for it)."""
        if self._next_batch_ms is None:
            return self._next_prune_ms
        return min(self._next_prune_ms, self._next_batch_ms)

    def prune_more(self, now: int) -> int:
        """One paced batch of fired timers; return the rows deleted."""
        deleted = housekeeping.prune_timers(self.db, self.conf, now)
        self._follow_up(now, deleted)
        return deleted

    def _follow_up(self, now: int, deleted: int) -> None:
        """Pace the next batch from what this one found.

        Full: rows are waiting, the next in ``PRUNE_STEP_MS``. Some: they pass retention
        at about ``deleted`` per the time since the last batch, the next when about
        ``PRUNE_TARGET_ROWS`` more have (between ``PRUNE_STEP_MS`` and a pass's period).
        None: fires stamp their rows a turn at a time, so a short gap can find none; look
        again after twice the gap, and stop until the next pass once that reaches a
        pass's period (fires have stopped).
        """
        self._pruned_rows += deleted
        since = PRUNE_EVERY_MS if self._last_batch_ms is None else now - self._last_batch_ms
        self._last_batch_ms = now
        if deleted >= housekeeping.TIMER_BATCH:
            delay = PRUNE_STEP_MS
        elif deleted:
            delay = since * PRUNE_TARGET_ROWS // deleted
        else:
            delay = 2 * since
            if delay >= PRUNE_EVERY_MS:
                self._next_batch_ms = self._last_batch_ms = None
                self._log_pruned()
                return
        self._next_batch_ms = now + min(max(delay, PRUNE_STEP_MS), PRUNE_EVERY_MS)

    def _log_pruned(self) -> None:
        if self._pruned_rows:
            event(log, logging.INFO, "timers.pruned", rows=self._pruned_rows, node=self.node)
        self._pruned_rows = 0

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
