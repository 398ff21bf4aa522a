"""TimingWheel against a reference model (a heap), under random interleavings (hypothesis).

The model is the obvious correct structure: a heap of ``(fire_at, seq, id)`` with lazily
skipped cancellations. Whatever the wheel's shape, the wheel must return exactly what the
model returns, in the same order, after every operation.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from durable.core.wheel import TimingWheel

MS, MINUTE, DAY = 1, 60_000, 86_400_000
YEAR = 365 * DAY

# (levels, slots, tick_ms): the default, and shapes small enough that random time jumps
# cross every level boundary and lean on the overflow constantly.
SHAPES = [(5, 256, 1), (1, 2, 1), (2, 4, 1), (3, 8, 1), (3, 16, 1), (2, 8, 7), (4, 4, 1_000)]
# cascade_budget: 1 and 2 make every pre-split span many calls, with inserts and cancels
# landing in each of its phases (source, mid, late, stage); 2048 finishes most in one.
BUDGETS = st.sampled_from([1, 2, 5, 2048])

FIRE_DELAYS = st.one_of(
    st.integers(-1_000, 1_000),  # overdue, due now, or the next ms
    st.integers(0, 60 * DAY),
    st.integers(0, 40 * YEAR),
)
TIME_STEPS = st.one_of(
    st.integers(1, 3),
    st.integers(1, 300),
    st.integers(1, 70_000),
    st.integers(1, 60 * DAY),
    st.integers(-50, 0),  # a clock estimate that steps back
)


class HeapModel:
    """Reference semantics: what the wheel's docstring promises, written the obvious way."""

    def __init__(self, tick_ms: int, start_ms: int) -> None:
        self.tick = tick_ms
        self.time_ms = start_ms
        self.heap: list[tuple[int, int, Hashable]] = []
        self.overdue: list[tuple[int, int, Hashable]] = []
        self.live: dict[Hashable, int] = {}
        self.seq = 0

    def _tick_of(self, fire_at_ms: int) -> int:
        return -(-fire_at_ms // self.tick)

    def insert(self, timer_id: Hashable, fire_at_ms: int) -> None:
        if timer_id in self.live:
            raise ValueError("pending")
        self.seq += 1
        self.live[timer_id] = self.seq
        entry = (fire_at_ms, self.seq, timer_id)
        if self._tick_of(fire_at_ms) <= self.time_ms // self.tick:
            self.overdue.append(entry)
        else:
            heapq.heappush(self.heap, entry)

    def cancel(self, timer_id: Hashable) -> bool:
        return self.live.pop(timer_id, None) is not None

    def advance(self, now_ms: int) -> list[Hashable]:
        due = sorted(self.overdue)
        self.overdue = []
        self.time_ms = max(self.time_ms, now_ms)
        now_tick = self.time_ms // self.tick
        while self.heap and self._tick_of(self.heap[0][0]) <= now_tick:
            due.append(heapq.heappop(self.heap))
        out = []
        for _, seq, timer_id in due:
            if self.live.get(timer_id) == seq:
                del self.live[timer_id]
                out.append(timer_id)
        return out

    def earliest_pending_ms(self) -> int | None:
        """The fire time (rounded up to its tick) of the earliest pending timer."""
        ticks = [self._tick_of(f) for f, s, i in self.heap if self.live.get(i) == s]
        return min(ticks) * self.tick if ticks else None


class WheelAgainstModel(RuleBasedStateMachine):
    """Random interleavings of insert, cancel and advance, checked after every step."""

    wheel: TimingWheel[int]
    model: HeapModel

    @initialize(shape=st.sampled_from(SHAPES), start=st.integers(0, 2**41), budget=BUDGETS)
    def create(self, shape: tuple[int, int, int], start: int, budget: int) -> None:
        levels, slots, tick_ms = shape
        self.levels = levels
        self.inserted = 0
        self.wheel = TimingWheel(levels, slots, tick_ms, start, cascade_budget=budget)
        self.model = HeapModel(tick_ms, start)

    @rule(timer_id=st.integers(0, 40), delay=FIRE_DELAYS)
    def insert(self, timer_id: int, delay: int) -> None:
        fire_at = self.model.time_ms + delay
        try:
            self.model.insert(timer_id, fire_at)
        except ValueError:
            try:
                self.wheel.insert(timer_id, fire_at)
            except ValueError:
                return
            raise AssertionError("inserting a pending id must raise") from None
        assert self.wheel.insert(timer_id, fire_at) == timer_id
        self.inserted += 1

    @rule(timer_id=st.integers(0, 40))
    def cancel(self, timer_id: int) -> None:
        assert self.wheel.cancel(timer_id) == self.model.cancel(timer_id)

    @rule(step=TIME_STEPS)
    def advance(self, step: int) -> None:
        now = self.model.time_ms + step
        assert self.wheel.advance(now) == self.model.advance(now)
        assert self.wheel.time_ms == self.model.time_ms

    @precondition(lambda self: len(self.model.live) > 0)
    @rule()
    def advance_to_next_expiry(self) -> None:
        at = self.wheel.next_expiry()
        assert at is not None
        assert self.wheel.advance(at) == self.model.advance(at)

    @invariant()
    def same_pending(self) -> None:
        assert len(self.wheel) == len(self.model.live)
        assert self.wheel.cascades <= (self.levels - 1) * self.inserted

    @invariant()
    def next_expiry_is_a_safe_lower_bound(self) -> None:
        expiry = self.wheel.next_expiry()
        if not self.model.live:
            assert expiry is None
            return
        assert expiry is not None
        if any(self.model.live.get(i) == s for _, s, i in self.model.overdue):
            assert expiry == self.wheel.time_ms
            return
        earliest = self.model.earliest_pending_ms()
        assert earliest is not None
        assert self.wheel.time_ms < expiry <= earliest


# No deadline and no too_slow check: CI machines are shared, and slowness is not a bug here.
RELAXED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
WheelAgainstModel.TestCase.settings = settings(max_examples=250, stateful_step_count=60, **RELAXED)
TestWheelAgainstModel = WheelAgainstModel.TestCase


@settings(max_examples=150, **RELAXED)
@given(
    shape=st.sampled_from(SHAPES),
    start=st.integers(0, 2**41),
    delays=st.lists(FIRE_DELAYS, min_size=1, max_size=300),
    cancel_every=st.integers(2, 10),
    steps=st.lists(st.integers(1, 60 * DAY), min_size=1, max_size=40),
    budget=BUDGETS,
)
def test_bulk_schedules_fire_like_the_model(
    shape: tuple[int, int, int],
    start: int,
    delays: list[int],
    cancel_every: int,
    steps: list[int],
    budget: int,
) -> None:
    """Hundreds of timers, some cancelled, then big jumps: identical, ordered, never early."""
    levels, slots, tick_ms = shape
    wheel: TimingWheel[int] = TimingWheel(levels, slots, tick_ms, start, cascade_budget=budget)
    model = HeapModel(tick_ms, start)
    fire = {}
    for i, delay in enumerate(delays):
        fire[i] = start + delay
        wheel.insert(i, fire[i])
        model.insert(i, fire[i])
    for i in range(0, len(delays), cancel_every):
        assert wheel.cancel(i) is model.cancel(i) is True
    now = start
    for step in [*steps, 41 * YEAR]:
        now += step
        out = wheel.advance(now)
        assert out == model.advance(now)
        assert all(fire[i] <= now for i in out)  # never early
        assert all(wheel.cancel(i) is False for i in out)  # cancel after fire: no-op
    assert len(wheel) == 0
