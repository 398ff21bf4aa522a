"""A debounced timer in a real worker engine (manual clock): it fires once, at the right time.

The timer is loaded into its shard's wheel at its first due time before a later call
moves it, so a worker that trusted its wheel would fire it early; the tests check that
it fires once, with the last call's arguments, never before the last call + debounce
(or the ``max_wait`` bound).
"""

from __future__ import annotations

from datetime import timedelta

import pytest

import durable
from durable.models import Timer
from testproject.demo import probes
from testproject.demo.models import FireRecord

pytestmark = pytest.mark.django_db(transaction=True)
S = 1_000


def engine_rescanning_every(start_engine, seconds: float):
    settings = {"SHARDS": 2, "RESCAN_INTERVAL_S": seconds}
    return start_engine(settings, node="debounce-node", threads=1)


def call(label: str, **options) -> Timer:
    options.setdefault("debounce", timedelta(seconds=5))
    return durable.schedule(probes.record, args=[label], key="search:reindex", **options)


def fires() -> list[tuple[str, int]]:
    return list(FireRecord.objects.order_by("id").values_list("key", "fired_at_ms"))


def test_a_moved_timer_fires_once_at_the_last_call_plus_debounce(start_engine, clock):
    # No rescan within the test's 30 s: the timers reach the wheel only as their NOTIFY
    # would bring them, so a move the wheel cannot see would fire late, not on time.
    engine = engine_rescanning_every(start_engine, 60.0)
    start = clock.now_ms()
    first = call("first")
    assert engine.runners[first.shard].add(first.pk, first.fire_at_ms)
    clock.advance(3 * S)
    engine.tick()
    last = call("last")  # due at start + 8 s now
    assert engine.runners[last.shard].add(last.pk, last.fire_at_ms)
    while clock.now_ms() < start + 8 * S - 100:  # its old time (start + 5 s) passes
        clock.advance(100)
        engine.tick()
        assert fires() == []
    clock.advance(100)
    engine.tick()
    assert fires() == [("last", start + 8 * S)]
    for _ in range(20):
        clock.advance(S)
        engine.tick()
    assert fires() == [("last", start + 8 * S)]
    assert not Timer.objects.filter(state="pending").exists()


def test_steady_calls_fire_at_each_max_wait_bound_then_after_the_quiet(start_engine, clock):
    engine = engine_rescanning_every(start_engine, 1.0)  # it finds each new row in time
    start = clock.now_ms()
    for second in range(26):  # a call every second for 25 s, then quiet
        call(f"c{second}", max_wait=timedelta(seconds=10))
        engine.tick()
        clock.advance(S)
    for _ in range(10):
        engine.tick()
        clock.advance(S)
    # Burst 1 from 0 s, bound 10 s; the call at 11 s finds it fired and starts burst 2
    # (bound 21 s); burst 3 starts at 22 s and ends 5 s after the last call, at 30 s.
    assert fires() == [("c10", start + 10 * S), ("c21", start + 21 * S), ("c25", start + 30 * S)]
