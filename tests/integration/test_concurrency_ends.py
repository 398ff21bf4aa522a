"""Every path that ends, moves or removes a timer of a concurrency key frees its slot.

A key's line only moves when something calls :func:`durable.storage.concurrency.release`
in the transaction that takes a timer out of it: these pin the paths other than an
attempt's own end (``test_concurrency_keys.py``): a dead letter by ``give_up``, the
operator's fire now / reschedule / retry, and a debounced call.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

import durable
from durable.conf import get_settings
from durable.models import ShardLease, Timer
from durable.scheduling import operations
from durable.storage.concurrency import PARKED_MS
from durable.worker.outcomes import Outcomes
from tests.integration import concurrency_support as support
from tests.integration.test_concurrency_keys import at, finish, row, started, ticked_until

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def engine(start_engine):
    support.STARTED.clear()
    support.GATES.clear()
    yield start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}, threads=8)
    for gate in support.GATES.values():
        gate.set()


def line(engine, clock, count, **options):
    """``count`` gated calls of account acme, due in n's order: 1 and 2 run, the rest wait."""
    base = clock.now_ms()
    timers = [
        durable.schedule(support.gated, args=["acme", n], at=at(base + n), **options)
        for n in range(1, count + 1)
    ]
    clock.advance(1_000)
    engine.tick()
    assert started(2) == [1, 2]
    assert all(row(t).fire_at_ms == PARKED_MS for t in timers[2:])
    return timers


def test_a_running_timer_dead_lettered_by_give_up_wakes_the_next(engine, clock):
    timers = line(engine, clock, 3)
    first = row(timers[0])
    token = ShardLease.objects.get(shard=first.shard).token
    outcomes = Outcomes(db="default", conf=get_settings(), metrics=None)
    # What the firer does when firing it failed on durable's own bookkeeping.
    assert outcomes.give_up(first.shard, token, first.pk, ValueError("no"), clock.now_ms())
    assert row(timers[0]).state == "failed"
    assert row(timers[2]).fire_at_ms == clock.now_ms(), "its slot went to the next in line"
    clock.advance(1_000)
    assert ticked_until(engine, lambda: 3 in support.STARTED)
    assert started(3) == [1, 2, 3]


def test_fire_now_of_a_waiting_timer_keeps_its_key_and_its_place(engine, clock):
    timers = line(engine, clock, 4)
    old = row(timers[3])
    moved = operations.fire_now(old.pk)
    assert moved is not None
    assert (moved.concurrency_key, moved.queued_ms) == (old.concurrency_key, old.queued_ms)
    clock.advance(1_000)
    # Over the limit it waits again, in its place: the limit binds the operator too.
    assert ticked_until(engine, lambda: row(moved).fire_at_ms == PARKED_MS)
    assert started(2) == [1, 2]
    finish(timers[0])
    assert row(timers[2]).fire_at_ms == clock.now_ms(), "3 came first, and still does"
    assert row(moved).fire_at_ms == PARKED_MS


def test_rescheduling_a_woken_timer_gives_its_slot_to_the_next(engine, clock):
    timers = line(engine, clock, 4)
    finish(timers[0])  # wakes 3
    assert row(timers[2]).fire_at_ms == clock.now_ms()
    moved = operations.reschedule(timers[2].pk, delay=timedelta(hours=1))
    assert moved is not None
    assert (moved.concurrency_key, moved.queued_ms) == (timers[2].concurrency_key, None)
    assert row(timers[3]).fire_at_ms == clock.now_ms(), "4 got the slot 3 held"
    clock.advance(1_000)
    assert ticked_until(engine, lambda: 4 in support.STARTED)
    assert started(3) == [1, 2, 4]


def test_retrying_a_dead_lettered_timer_keeps_its_key():
    timer = durable.schedule(support.gated, args=["acme", 1])
    Timer.objects.filter(pk=timer.pk).update(state="failed")
    again = operations.retry(timer.pk)
    assert again is not None
    assert (again.concurrency_key, again.queued_ms) == (timer.concurrency_key, None)


def test_a_debounced_call_leaves_a_waiting_timer_in_its_place(engine, clock):
    timers = line(engine, clock, 4, key=None)
    # Its key is the debounce key: durable's per-call key, not the concurrency key.
    waiting = row(timers[2])
    Timer.objects.filter(pk=waiting.pk).update(key="export-acme")
    again = durable.schedule(
        support.gated, args=["acme", 30], key="export-acme", debounce=timedelta(seconds=5)
    )
    assert again.pk == waiting.pk
    now = row(waiting)
    assert (now.fire_at_ms, now.queued_ms, now.args) == (PARKED_MS, waiting.queued_ms, ["acme", 30])
    finish(timers[0])
    assert row(waiting).fire_at_ms == clock.now_ms(), "woken in its place, before 4"
    assert row(timers[3]).fire_at_ms == PARKED_MS
    clock.advance(1_000)
    assert ticked_until(engine, lambda: 30 in support.STARTED)
    assert started(3) == [1, 2, 30], "the last call's arguments, within the limit"


def test_a_debounced_call_that_moves_a_woken_timer_gives_its_slot_to_the_next(engine, clock):
    timers = line(engine, clock, 4)
    Timer.objects.filter(pk=timers[2].pk).update(key="export-acme")
    finish(timers[0])  # wakes 3
    assert row(timers[2]).fire_at_ms == clock.now_ms()
    again = durable.schedule(
        support.gated, args=["acme", 30], key="export-acme", debounce=timedelta(seconds=5)
    )
    assert again.fire_at_ms == clock.now_ms() + 5_000 and again.queued_ms is None
    assert row(timers[3]).fire_at_ms == clock.now_ms(), "4 got the slot 3 held"
    clock.advance(1_000)
    assert ticked_until(engine, lambda: 4 in support.STARTED)
    assert started(3) == [1, 2, 4]


def test_cancelling_a_keyed_timer_whose_key_never_came_due_cancels_it():
    # No batch has decided for the key yet: it has no row, and nothing waits in its line.
    timer = durable.schedule(support.gated, args=["acme", 1], delay=timedelta(hours=1))
    assert durable.cancel(timer)
    assert row(timer).state == "canceled"


def test_an_attempt_that_gives_up_frees_its_slot_for_the_next(engine, clock):
    base = clock.now_ms()
    first, second = (
        durable.schedule(support.gives_up, args=["acme", n], at=at(base + n)) for n in (1, 2)
    )
    clock.advance(1_000)
    assert ticked_until(engine, lambda: 2 in support.STARTED)
    assert (row(first).state, row(first).attempts) == ("failed", 1), "dead-lettered at once"
    assert ticked_until(engine, lambda: row(second).state == "fired")


def test_a_woken_timer_dead_lettered_for_bad_stored_args_frees_its_slot(engine, clock):
    timers = line(engine, clock, 4)
    finish(timers[0])  # wakes 3, whose row a bad write then breaks
    Timer.objects.filter(pk=timers[2].pk).update(args={"not": "a list"})
    clock.advance(1_000)
    assert ticked_until(engine, lambda: row(timers[2]).state == "failed")
    assert ticked_until(engine, lambda: 4 in support.STARTED)
    assert started(3) == [1, 2, 4]


def test_a_claim_found_with_every_attempt_used_is_dead_lettered_and_frees_its_slot(engine, clock):
    timers = line(engine, clock, 3)
    # Attempt 1 of 1 never recorded an outcome, and its claim expired: a poison timer.
    Timer.objects.filter(pk=timers[0].pk).update(max_attempts=1, claim_expires_ms=clock.now_ms())
    clock.advance(1_000)
    assert ticked_until(engine, lambda: row(timers[0]).state == "failed")
    assert "attempt 1 of 1 started and never finished" in row(timers[0]).last_error
    assert ticked_until(engine, lambda: 3 in support.STARTED)
    assert started(3) == [1, 2, 3]
