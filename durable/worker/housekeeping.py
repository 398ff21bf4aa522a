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
from durable.storage import retention, statements
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


#: Fired and cancelled timers deleted per batch, each batch its own short transaction.
#: At most this many fired and cancelled timers a batch: one batch held the worker's
#: loop 15-32 ms at load 11-13 on 2 shared cores, against 65-114 ms for 1,000
#: (``bench/prune_batch.py``; docs/benchmarks.md, "Soak").
TIMER_BATCH = 200


def prune(db: str, conf: DurableSettings, now_ms: int, node: str, *, timers: bool = True) -> int:
    """Delete rows past their retention, in small batches; return how many were deleted.

    Fired and cancelled timers after ``RETENTION_DAYS`` (one batch of ``TIMER_BATCH``:
    the chores pace more batches after it, see :func:`prune_timers`), failed ones after
    ``FAILED_RETENTION_DAYS`` (at most 1,000), finished workflow runs with their steps
    and signals after ``RUN_RETENTION_DAYS`` (at most 2,000 runs); ``None`` keeps that
    kind forever. Each batch is its own short transaction; the engine runs this between
    turns, after the fires (``durable.worker.chores``, which prunes the fired timers
    itself: ``timers=False``).
    """
    total = prune_timers(db, conf, now_ms) if timers else 0
    if conf.FAILED_RETENTION_DAYS is not None:
        cutoff = retention.cutoff_ms(now_ms, conf.FAILED_RETENTION_DAYS)
        total += retention.prune_failed_timers(db, cutoff)
    if total:
        event(log, logging.INFO, "timers.pruned", rows=total, node=node)
    runs = 0
    if conf.RUN_RETENTION_DAYS is not None:
        cutoff = retention.cutoff_ms(now_ms, conf.RUN_RETENTION_DAYS)
        for _ in range(4):
            deleted = retention.prune_runs(db, cutoff)
            runs += deleted
            if deleted < 500:
                break
    if runs:
        event(log, logging.INFO, "runs.pruned", runs=runs, node=node)
    return total + runs


def prune_timers(db: str, conf: DurableSettings, now_ms: int) -> int:
    """One batch (``TIMER_BATCH``) of fired and cancelled timers past ``RETENTION_DAYS``.

    The chores repeat this between turns, paced to the rate rows pass retention
    (``durable.worker.chores``): small batches spread evenly keep up with the fire rate
    while the loop is held a few ms at a time (batches of 1,000 in bursts held it for
    55-130 ms each, and 10 in a row for seconds).
    """
    cutoff = firing_store.retention_cutoff_ms(now_ms, conf.RETENTION_DAYS)
    return retention.prune_finished(db, cutoff, batch=TIMER_BATCH)


def guard_session(connection: Any, conf: DurableSettings) -> None:
    """Make PostgreSQL abort the loop's transactions left idle past twice the lease TTL.

    A worker frozen (SIGSTOP, VM pause) inside a firing transaction holds its lease row
    lock; other workers skip locked rows, so without this the shard would wait for the
    frozen worker. Atomic handlers must therefore stay short; long work goes to
    ``atomic=False`` handlers, which run outside the batch transaction.

    The timeout is set for each transaction (``set_config(..., true)``, as ``SET LOCAL``)
    as its first statement, never for the session: behind a pooler in transaction mode the
    session is a server connection shared with other clients, which a session-level
    setting would leak to, while the loop's next transaction may run on a server
    connection that never got it. Per transaction, the guard holds on any connection and
    ends with the transaction. It costs one round trip per transaction of the loop, none
    where the transaction's first statement carries it (the firing batch's, see
    :class:`IdleGuard`).
    """
    if connection.vendor != "postgresql":
        return
    # One guard per connection, this engine's: an earlier engine's (other settings, in
    # the same process) is replaced, not kept.
    unguard_session(connection)
    connection.execute_wrappers.append(IdleGuard(max(5_000, int(conf.LEASE_TTL_S * 2000))))


def unguard_session(connection: Any) -> None:
    """Remove :func:`guard_session`'s guard from ``connection`` (when the engine stops)."""
    connection.execute_wrappers[:] = [
        w for w in connection.execute_wrappers if not isinstance(w, IdleGuard)
    ]


class IdleGuard:
    """A Django execute wrapper: the first statement of each transaction sets the timeout.

    The fire loop's own first statements (the batch's lock, a fence) carry
    :data:`durable.storage.statements.IDLE_GUARD`: there the guard writes its timeout into
    the statement, which then sets it before it locks anything, and sends nothing of its
    own. Any other first statement is preceded by a ``set_config`` of its own (one more
    round trip).
    """

    def __init__(self, timeout_ms: int) -> None:
        self.setting = statements.idle_guard(timeout_ms)
        self.sql = f"SELECT {self.setting}"

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        connection = context["connection"]
        raw = connection.connection
        if statements.IDLE_GUARD in sql:
            # Wherever it comes in a transaction: one statement text (preparable), and
            # setting the timeout again does no harm.
            return execute(sql.replace(statements.IDLE_GUARD, self.setting), params, many, context)
        # Outside autocommit and with no transaction open on the server (status IDLE, 0
        # in psycopg 2 and 3): this statement would begin one, so set the timeout first.
        if not connection.get_autocommit() and raw.info.transaction_status == 0:
            with connection.wrap_database_errors:
                context["cursor"].cursor.execute(self.sql)
        return execute(sql, params, many, context)
