"""Concurrency keys on one engine, turn by turn: the limit, the line, and who is woken.

The two-worker proof (1,000 timers, a kill mid-way) is
``tests/acceptance/test_concurrency_cluster.py``; these pin the rules on a manual clock.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
from django.db import transaction
from django.db.models import Min

import durable
from durable.core.ratelimit import parse_rate
from durable.core.sharding import shard_for
from durable.dispatch.concurrency import ConcurrencyKeyError
from durable.limits import ConcurrencyKey
from durable.models import Timer
from durable.storage import concurrency
from durable.storage.concurrency import PARKED_MS
from testproject.demo.models import FireRecord
from tests.integration import concurrency_support as support
from tests.integration.conftest import START_MS
from tests.integration.polling import wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def engine(start_engine):
    support.STARTED.clear()
    support.GATES.clear()
    yield start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}, threads=8)
    for gate in support.GATES.values():
        gate.set()


def at(ms):
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def row(timer):
    return Timer.objects.get(pk=timer.pk)


def finish(timer):
    """Open the gate of ``timer``'s call and wait until its completion committed."""
    support.GATES.setdefault(timer.args[1], threading.Event()).set()
    assert wait_for(lambda: row(timer).state != "firing"), f"{timer.args} did not complete"


def ticked_until(engine, predicate):
    for _ in range(100):
        engine.tick()
        if predicate():
            return True
        time.sleep(0.02)
    return False


def started(count):
    assert wait_for(lambda: len(support.STARTED) >= count), support.STARTED
    time.sleep(0.05)  # and no more than that
    return list(support.STARTED)


def test_over_the_limit_waits_parked_and_is_woken_in_arrival_order(engine, clock):
    # Due in n's order, scheduled (and so numbered) in another: ids do not decide.
    base = clock.now_ms()
    timers = {
        n: durable.schedule(support.gated, args=["acme", n], at=at(base + 100 * n))
        for n in (4, 1, 6, 2, 3, 5)
    }
    clock.advance(1_000)
    engine.tick()
    assert started(2) == [1, 2]
    assert [row(timers[n]).state for n in range(1, 7)] == ["firing"] * 2 + ["pending"] * 4
    parked = row(timers[5])
    assert (parked.fire_at_ms, parked.queued_ms) == (PARKED_MS, base + 500)
    assert parked.attempts == 0, "a parked timer's attempt is given back"

    finish(timers[2])  # a slot frees: the oldest waiting one (3) is made due now
    assert row(timers[3]).fire_at_ms == clock.now_ms()
    assert row(timers[4]).fire_at_ms == PARKED_MS
    engine.tick()
    assert started(3) == [1, 2, 3]
    for n, woken in ((1, 4), (3, 5), (4, 6)):
        finish(timers[n])
        assert ticked_until(engine, lambda woken=woken: woken in support.STARTED)
        assert started(woken) == list(range(1, woken + 1))
    for n in (5, 6):
        finish(timers[n])
    assert [row(timers[n]).state for n in range(1, 7)] == ["fired"] * 6
    assert row(timers[6]).queued_ms is None, "admitted: it left the line"


def test_claim_re_runs_in_the_batch_hold_their_slots_from_a_new_arrival(clock):
    # A new owner's first batch: two attempts of the key claimed by a dead worker (firing,
    # re-run now) and a call that came due meanwhile. The re-runs hold both slots.
    timers = [durable.schedule(support.gated, args=["acme", n]) for n in (1, 2, 3)]
    ids = [timer.pk for timer in timers]
    Timer.objects.filter(pk__in=ids).update(attempts=1)
    Timer.objects.filter(pk__in=ids[:2]).update(state="firing")
    with transaction.atomic():
        limits = dict.fromkeys(ids, (2, None))
        assert concurrency.admit("default", limits, clock.now_ms(), 16) == {ids[2]}
    assert row(timers[2]).fire_at_ms == PARKED_MS


def test_a_woken_timer_keeps_its_slot_from_a_later_arrival(engine, clock):
    base = clock.now_ms()
    timers = [durable.schedule(support.gated, args=["acme", n], at=at(base + n)) for n in (1, 2, 3)]
    clock.advance(1_000)
    engine.tick()
    assert started(2) == [1, 2]
    finish(timers[0])  # wakes 3, which has not fired yet
    late = durable.schedule(support.gated, args=["acme", 9])  # due now, new to the line
    Timer.objects.filter(pk=late.pk).update(attempts=1)  # as the batch would have counted
    with transaction.atomic():  # the decision a batch holding only `late` would make
        assert concurrency.admit("default", {late.pk: (2, None)}, clock.now_ms(), 16) == {late.pk}
    assert row(late).fire_at_ms == PARKED_MS, "the later arrival waits behind 3"
    engine.tick()
    assert started(3) == [1, 2, 3], "the woken timer took the slot"


def test_cancelling_a_woken_timer_gives_its_slot_to_the_next(engine, clock):
    base = clock.now_ms()
    timers = [
        durable.schedule(support.gated, args=["acme", n], at=at(base + n)) for n in (1, 2, 3, 4)
    ]
    clock.advance(1_000)
    engine.tick()
    assert started(2) == [1, 2]
    finish(timers[0])  # wakes 3; cancel it before the engine fires it
    assert row(timers[2]).fire_at_ms != PARKED_MS
    assert durable.cancel(timers[2])
    assert row(timers[3]).fire_at_ms == clock.now_ms(), "4 got the slot 3 held"
    clock.advance(1_000)  # the rescan (or the NOTIFY of the cancel's commit) finds it
    engine.tick()
    assert started(3) == [1, 2, 4]


def test_keys_route_to_the_keys_shard_and_are_scoped_by_handler(settings):
    settings.DURABLE = {"SHARDS": 64}
    timer = durable.schedule(support.gated, args=["acme", 1])
    name = "tests.integration.concurrency_support.gated:acme"
    assert timer.concurrency_key == name
    assert timer.shard == shard_for(name, 64)


@pytest.mark.parametrize(
    ("n", "message"),
    [(0, "raised LookupError: no account"), (-1, "returned -1 (of type int), not a str")],
)
def test_a_key_callable_that_fails_is_a_clear_error_and_writes_nothing(n, message):
    with pytest.raises(ConcurrencyKeyError, match="concurrency_key of handler") as caught:
        durable.schedule(support.badly_keyed, args=["acme", n])
    assert message in str(caught.value)
    assert not Timer.objects.exists()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"concurrency_key": "k"}, TypeError, "goes with max_concurrency and/or rate_limit"),
        ({"max_concurrency": 2}, TypeError, "goes with"),
        ({"rate_limit": "1/s"}, TypeError, "goes with"),
        ({"concurrency_key": "k", "rate_limit": "10/d"}, ValueError, "N/s, N/m or N/h"),
        ({"concurrency_key": "k", "rate_limit": "0/m"}, ValueError, "N must be 1 to"),
        ({"concurrency_key": "k", "rate_limit": 10}, TypeError, "expected a str"),
        ({"concurrency_key": "k", "max_concurrency": 0}, ValueError, "must be >= 1"),
        ({"concurrency_key": "k", "max_concurrency": 2.0}, TypeError, "expected an int"),
        ({"concurrency_key": 5, "max_concurrency": 2}, TypeError, "a str or a callable"),
        ({"concurrency_key": "", "max_concurrency": 2}, ValueError, "1 to 120"),
        ({"concurrency_key": "a\x00b", "max_concurrency": 2}, ValueError, "NUL"),
    ],
)
def test_bad_options_are_refused_at_declaration(options, error, message):
    with pytest.raises(error, match=message):
        durable.handler(**options)


def test_a_rate_limit_holds_over_every_window_and_loses_nothing(engine, clock):
    """5,000 calls in one burst on 3 keys at 100/s: on the manual clock, each key's starts
    never exceed 100 in any 1 s window, and every call runs once. Deferred calls wait as
    timers: the clock jumps straight to the next one due, nothing polls. (The issue's
    10/s takes ten times the turns, 333: 25 s at load 12-14, for the same proof.)"""
    calls = 5_000
    durable.schedule_many({"fn": support.rated, "args": [f"k{n % 3}", n]} for n in range(calls))
    clock.advance(1_000)
    turns = 0
    while FireRecord.objects.count() < calls:
        engine.tick()
        turns += 1
        assert turns < 200, f"stuck at {FireRecord.objects.count()} of {calls}"
        due = Timer.objects.filter(state="pending", fire_at_ms__lt=PARKED_MS).aggregate(
            m=Min("fire_at_ms")
        )["m"]
        if due is not None and due > clock.now_ms():
            clock.set(due)
        elif due is None and FireRecord.objects.count() < calls:
            clock.advance(1_000)  # a woken timer's NOTIFY lost: the rescan finds it
    runs: dict[str, list[int]] = {}
    for key, at in FireRecord.objects.values_list("key", "fired_at_ms"):
        runs.setdefault(key.split(":")[0], []).append(at)
    assert (
        sum(map(len, runs.values())) == calls == FireRecord.objects.values("key").distinct().count()
    )
    for key, times in runs.items():
        times.sort()
        crowded = [(a, b) for a, b in zip(times, times[100:], strict=False) if b - a < 1_000]
        assert not crowded, f"{key}: 101 starts within 1 s: {crowded[:3]}"
    took_s = (clock.now_ms() - START_MS) / 1000
    assert took_s < calls / 3 / 100 + 3, f"{took_s} s of clock time: slower than the rate"
    assert turns < 60, f"{turns} turns: deferred calls were retried, not woken in order"


def test_a_failed_attempt_frees_its_slot_for_the_next_in_line(engine, clock):
    base = clock.now_ms()
    first, second = (
        durable.schedule(support.fails_first, args=["acme", n], at=at(base + n)) for n in (1, 2)
    )
    clock.advance(1_000)
    engine.tick()
    assert wait_for(lambda: row(first).state == "pending" and row(first).attempts == 1)
    assert row(first).fire_at_ms > clock.now_ms(), "retried after its backoff"
    assert row(second).fire_at_ms == clock.now_ms(), "the failure woke the next in line"
    assert ticked_until(engine, lambda: row(second).state == "fired")
    assert row(first).queued_ms is None, "a retry is a new arrival"


def test_a_timer_admitted_but_left_for_a_free_thread_keeps_its_place(start_engine, clock):
    """One thread for a key of two: the second admitted each turn waits for the thread,
    and must keep its place in line (and its slot) until it starts, not come back as a
    new arrival behind timers that came due after it."""
    support.STARTED.clear()
    support.GATES.clear()
    engine = start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}, threads=1)
    base = clock.now_ms()
    timers = {
        n: durable.schedule(support.gated, args=["acme", n], at=at(base + 100 * n))
        for n in (3, 1, 5, 2, 4)
    }
    try:
        clock.advance(1_000)
        engine.tick()
        assert started(1) == [1]
        left = row(timers[2])
        assert (left.state, left.queued_ms) == ("pending", base + 200), "2 holds its place"
        assert row(timers[3]).fire_at_ms == PARKED_MS, "2 holds the key's second slot"
        for n in (1, 2, 3, 4):
            finish(timers[n])
            assert ticked_until(engine, lambda n=n: n + 1 in support.STARTED)
            assert started(n + 1) == list(range(1, n + 2)), "arrival order"
        finish(timers[5])
        assert [row(timers[n]).state for n in range(1, 6)] == ["fired"] * 5
        assert Timer.objects.filter(queued_ms__isnull=False).count() == 0, "all left the line"
    finally:
        for gate in support.GATES.values():
            gate.set()


def test_a_rate_does_not_count_a_start_the_batch_left_for_later(clock):
    """A timer admitted under a rate and left for later (budget spent, no free thread)
    takes back the start its admission logged, and holds its place in line: at its next
    batch the window still has room for it."""
    keyed = durable.schedule(support.rated, args=["k", 1])
    Timer.objects.filter(pk=keyed.pk).update(attempts=1)  # as the batch would have counted
    now, limits = clock.now_ms(), {keyed.pk: (None, parse_rate("1/m"))}
    with transaction.atomic():
        assert concurrency.admit("default", limits, now, 16) == set()
        concurrency.settle("default", [], [keyed.pk], now)
    assert ConcurrencyKey.objects.get(name=keyed.concurrency_key).recent == []
    assert row(keyed).queued_ms == keyed.fire_at_ms, "it takes its place in line"
    with transaction.atomic():
        assert concurrency.admit("default", limits, now + 10, 16) == set(), "not deferred"
