"""The engine's chores that are not firing: clock offset, retention, session guard.

Kept apart from the loop in :mod:`durable.worker.engine` so that file reads as the loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from durable.conf import DurableSettings
from durable.core.clock import Clock, SystemClock
from durable.storage import firing as firing_store
from durable.storage import leases as lease_store
from durable.worker.logs import event

log = logging.getLogger("durable.worker")


def measure_offset(clock: Clock, db: str) -> None:
    """Set a :class:`SystemClock`'s offset so it never runs ahead of the database's clock.

    The database's reading happened somewhere between ``before`` and ``after``; taking
    ``db_now - after`` (not the midpoint) can only make the worker's clock lag the
    database's, by at most one round trip, so "never early" holds. Of five samples the one
    with the shortest round trip is kept; the connection is opened beforehand so that
    connecting does not widen the window. Other clocks (manual ones in tests) are left alone.
    """
    if not isinstance(clock, SystemClock):
        return
    if lease_store.database_now_ms(db) is None:  # no database clock; also opens the connection
        return
    best: tuple[int, int] | None = None  # (round trip, offset)
    for _ in range(5):
        before = time.time_ns() // 1_000_000
        db_now = lease_store.database_now_ms(db)
        after = -(-time.time_ns() // 1_000_000)  # ceiling: keeps the offset a lower bound
        assert db_now is not None
        if best is None or after - before < best[0]:
            best = (after - before, db_now - after)
    assert best is not None
    clock.offset_ms = best[1]


def prune(db: str, conf: DurableSettings, now_ms: int, node: str) -> int:
    """Delete finished rows past the retention, in small batches (at most 10,000 a call)."""
    cutoff = firing_store.retention_cutoff_ms(now_ms, conf.RETENTION_DAYS)
    total = 0
    for _ in range(10):
        deleted = firing_store.prune_finished(db, cutoff)
        total += deleted
        if deleted < 1000:
            break
    if total:
        event(log, logging.INFO, "timers.pruned", rows=total, node=node)
    return total


def guard_session(connection: Any, conf: DurableSettings) -> None:
    """Make PostgreSQL abort the loop's transactions left idle past twice the lease TTL.

    A worker frozen (SIGSTOP, VM pause) inside a firing transaction holds its lease row
    lock; other workers skip locked rows, so without this the shard would wait for the
    frozen worker. Atomic handlers must therefore stay short; long work goes to
    ``atomic=False`` handlers, which run outside the batch transaction.
    """
    if connection.vendor != "postgresql":
        return
    timeout_ms = max(5_000, int(conf.LEASE_TTL_S * 2000))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, false)",
            [str(timeout_ms)],
        )
