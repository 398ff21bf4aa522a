"""A due timer whose row another session holds locked does not hold its worker's turn.

A web request under ``ATOMIC_REQUESTS`` that cancelled or rescheduled a timer (or app
code with ``select_for_update()``) keeps the row locked until its transaction ends. The
worker used to wait on that lock in its count and its batch, and with it every other
timer of the batch and the rest of its loop (lease renewal included). Now the count
skips the row (``Counted.locked``), the batch fires the others, and the runner tries
the locked one again ``LOCKED_RETRY_MS`` later, until the row is free.

The engine's session gets a ``lock_timeout``: where the turn still waits on the lock
(before the change), it fails with an error after two seconds instead of hanging.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from django.db import InterfaceError, OperationalError, connections, transaction

import durable
from durable.models import Timer, TimerState
from durable.storage import claims
from durable.worker.counting import LOCKED_RETRY_MS
from testproject.demo import probes
from testproject.demo.models import FireRecord

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SETTINGS = {"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}


class _RollBack(Exception):
    """Ends a holder's transaction with a rollback."""


class Holder(threading.Thread):
    """Another session: runs ``action`` in a transaction, keeps it open until told to end
    it, then commits or rolls back (as a slow request under ``ATOMIC_REQUESTS`` does)."""

    def __init__(self, action: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.action = action
        self.locked = threading.Event()
        self.end = threading.Event()
        self.commit = True
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with transaction.atomic():
                self.action()
                self.locked.set()
                self.end.wait(30)
                if not self.commit:
                    raise _RollBack
        except _RollBack:
            pass
        except BaseException as exc:  # reported by finish()
            self.error = exc
        finally:
            self.locked.set()
            connections.close_all()

    def finish(self, *, commit: bool) -> None:
        self.commit = commit
        self.end.set()
        self.join(10)
        assert not self.is_alive() and self.error is None, self.error


@pytest.fixture
def engine(start_engine):
    engine = start_engine(dict(SETTINGS), threads=2)
    with connections["default"].cursor() as cursor:
        # Before the change, the turn waits on the held row: fail in 2 s, not hang.
        cursor.execute("SET lock_timeout = '2s'")
    return engine


def turn(engine, clock, step_ms=200):
    """One turn: its database error (a lock timeout) returned, not raised."""
    clock.advance(step_ms)
    started = time.monotonic()
    try:
        engine.tick()
    except (OperationalError, InterfaceError) as exc:
        engine._on_database_error(exc, 0.0)
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def state(timer):
    timer.refresh_from_db()
    return timer.state, timer.attempts


def ledger(prefix):
    return sorted(FireRecord.objects.filter(key__startswith=prefix).values_list("key", flat=True))


def due_timers(engine, clock, n, **options):
    """``n`` timers due now, in the wheels, the last one the one to lock."""
    timers = [durable.schedule(probes.record, args=[f"t{i}"], **options) for i in range(n)]
    clock.advance(1)
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    return timers[:-1], timers[-1]


def hold(action: Callable[[], object]) -> Holder:
    holder = Holder(action)
    holder.start()
    assert holder.locked.wait(10) and holder.error is None, holder.error
    return holder


def test_a_cancel_held_open_does_not_hold_the_turn_and_the_timer_never_fires(engine, clock):
    others, held = due_timers(engine, clock, 6)
    holder = hold(lambda: durable.cancel(held.pk))
    try:
        error, took = turn(engine, clock)
        assert error is None, f"the turn waited on the locked row: {error}"
        assert took < 1.5
        assert [state(t) for t in others] == [(TimerState.FIRED, 1)] * len(others)
        assert state(held) == (TimerState.PENDING, 0), "not fired, no attempt spent"
        assert ledger("t") == sorted(f"t{i}" for i in range(len(others)))
        for _ in range(3):  # still locked: retried, skipped again, never counted
            assert turn(engine, clock)[0] is None
        assert state(held) == (TimerState.PENDING, 0)
    finally:
        holder.finish(commit=True)
    for _ in range(3):
        assert turn(engine, clock)[0] is None
    assert state(held) == (TimerState.CANCELED, 0)
    assert f"t{len(others)}" not in ledger("t")


def test_a_lock_rolled_back_fires_the_timer_right_after_the_retry_delay(engine, clock):
    # One attempt: a skipped row taken for one with every attempt used would be
    # dead-lettered (AttemptsExhausted) instead of run.
    others, held = due_timers(engine, clock, 4, max_attempts=1)
    holder = hold(lambda: durable.cancel(held.pk))
    try:
        error, _ = turn(engine, clock)
        assert error is None, f"the turn waited on the locked row: {error}"
        assert [state(t) for t in others] == [(TimerState.FIRED, 1)] * len(others)
        assert state(held) == (TimerState.PENDING, 0)
        skipped = engine.metrics.registry.get_sample_value(
            "durable_timers_locked_skipped_total", {"shard": str(held.shard)}
        )
        assert skipped == 1, "the skip shows in the metrics"
    finally:
        holder.finish(commit=False)
    assert turn(engine, clock, step_ms=LOCKED_RETRY_MS)[0] is None
    assert state(held) == (TimerState.FIRED, 1)
    assert ledger("t") == sorted(f"t{i}" for i in range(len(others) + 1)), "once each"


def test_select_for_update_in_app_code_is_skipped_the_same_way(engine, clock):
    others, held = due_timers(engine, clock, 3)
    holder = hold(lambda: list(Timer.objects.select_for_update().filter(pk=held.pk)))
    try:
        assert turn(engine, clock)[0] is None
        assert [state(t) for t in others] == [(TimerState.FIRED, 1)] * len(others)
        assert state(held) == (TimerState.PENDING, 0)
    finally:
        holder.finish(commit=True)
    assert turn(engine, clock, step_ms=LOCKED_RETRY_MS)[0] is None
    assert state(held) == (TimerState.FIRED, 1)


def test_count_attempts_reports_locked_rows_apart_from_exhausted_and_not_due(engine, clock):
    free, locked, exhausted = (durable.schedule(probes.record, args=[k]) for k in "fle")
    later = durable.schedule(probes.record, args=["n"], delay=timedelta(days=1))
    Timer.objects.filter(pk=exhausted.pk).update(attempts=5, max_attempts=5)
    clock.advance(1)
    ids = [free.pk, locked.pk, exhausted.pk, later.pk]
    tokens = {r.shard: r.token for r in engine.runners.values()}
    holder = hold(lambda: list(Timer.objects.select_for_update().filter(pk=locked.pk)))
    try:
        with claims.counting("default"):
            counted = claims.count_attempts("default", tokens, ids, clock.now_ms())
    finally:
        holder.finish(commit=False)
    assert counted.ids == {free.pk}
    assert counted.locked == {locked.pk}, "not the exhausted one, not the one not due"
    assert state(locked) == (TimerState.PENDING, 0)
