"""TimingWheel: bounded work per advance (issue 16), the stages behind it, against a model.

A coarse slot is prepared ahead of time, a paced chunk per ``advance``, so time entering it
moves nothing. These tests pin what that must not break (never early, exact order, cancel
in every phase of a chunked move) and what it buys (moves per call bounded by the budget,
a jump that moves at most one slot per level of timers that are not due).
"""

from __future__ import annotations

import random

import pytest

from durable.core.wheel import TimingWheel
from tests.unit.test_wheel_properties import HeapModel

MINUTE, HOUR, DAY = 60_000, 3_600_000, 86_400_000
LEVEL3 = 1 << 24  # a level-3 slot of the default wheel: 4.66 h
EPOCH = 1_700_000_000_123


def near_boundaries(rnd: random.Random, now: int, slots: int, levels: int) -> int:
    """A fire time close to a slot boundary of a random level: where stages change hands."""
    span = slots ** rnd.randrange(1, levels + 1)
    boundary = (now // span + rnd.randrange(1, 3)) * span
    return max(0, boundary + rnd.randrange(-3, 4))


@pytest.mark.parametrize("budget", [1, 2, 7, 64])
@pytest.mark.parametrize(("levels", "slots", "tick_ms"), [(3, 4, 1), (4, 8, 1), (3, 16, 3)])
def test_random_runs_match_the_model_whatever_the_budget(
    levels: int, slots: int, tick_ms: int, budget: int
) -> None:
    """Seeded runs: inserts (many at boundaries and in ties), cancels, re-inserts, small
    steps and big jumps; the wheel returns exactly the model's ids, in its order."""
    for seed in range(25):
        rnd = random.Random(seed * 1_000 + budget)
        start = rnd.randrange(2**30)
        wheel: TimingWheel[int] = TimingWheel(levels, slots, tick_ms, start, budget)
        model = HeapModel(tick_ms, start)
        span = slots**levels
        for _ in range(600):
            now = model.time_ms
            roll = rnd.random()
            if roll < 0.45:
                timer_id = rnd.randrange(60)
                if timer_id in model.live:
                    continue
                if rnd.random() < 0.5:
                    fire_at = near_boundaries(rnd, now, slots, levels)
                else:
                    fire_at = now + rnd.choice([1, rnd.randrange(span), rnd.randrange(2 * span)])
                model.insert(timer_id, fire_at)
                wheel.insert(timer_id, fire_at)
            elif roll < 0.65:
                timer_id = rnd.randrange(60)
                assert wheel.cancel(timer_id) == model.cancel(timer_id)
            else:
                step = rnd.choice([1, 1, 2, 3, slots, rnd.randrange(span), 3 * span])
                out = wheel.advance(now + step)
                assert out == model.advance(now + step), seed
            assert len(wheel) == len(model.live)
        while model.live:  # drain as a runner does: sleep until next_expiry
            at = wheel.next_expiry()
            assert at is not None and (at > wheel.time_ms or wheel.pending_overdue())
            assert wheel.advance(at) == model.advance(at)


def runner_steps(wheel: TimingWheel[int], start: int, end: int, step: int) -> list[int]:
    """Advance in ``step`` ms from ``start`` to ``end``; return the timers moved per call."""
    moved = []
    for now in range(start + step, end + 1, step):
        before = wheel.cascades
        wheel.advance(now)
        moved.append(wheel.cascades - before)
    return moved


def loaded_across_level3(n: int, budget: int, seed: int = 1) -> tuple[TimingWheel[int], int]:
    """A runner's 70-minute horizon of ``n`` timers whose level-3 boundary is 30 min in."""
    boundary = (EPOCH // LEVEL3 + 1) * LEVEL3
    start = boundary - 30 * MINUTE
    wheel: TimingWheel[int] = TimingWheel(start_ms=start, cascade_budget=budget)
    rnd = random.Random(seed)
    for i in range(n):
        wheel.insert(i, start + 1 + rnd.randrange(70 * MINUTE))
    return wheel, boundary


def test_a_runner_crossing_a_level3_boundary_moves_at_most_the_budget_per_call() -> None:
    """The crossing that moved every loaded timer past it (57,130 in the issue) moves none."""
    wheel, boundary = loaded_across_level3(40_000, budget=256)
    start = boundary - 30 * MINUTE
    before_it = runner_steps(wheel, start, boundary - 10, 10)
    assert wheel.pending_per_level()[3] > 20_000  # 40 minutes of timers past the boundary
    before = wheel.cascades
    wheel.advance(boundary + 5)  # time enters the level-3 slot: a swap of rings
    assert wheel.cascades - before <= 256  # the pacing's share only, for the next slots
    assert wheel.pending_per_level()[3] == 0
    after_it = runner_steps(wheel, boundary + 5, start + 70 * MINUTE, 10)
    assert max(before_it + after_it) <= 256
    assert len(wheel) == 0


def test_a_caller_that_skips_the_pacing_pays_on_entering_and_stays_exact() -> None:
    """No call between the slot becoming next and time entering it: entering finishes the
    move (the old crossing's cost), and every timer still fires on its ms, in order."""
    boundary = (EPOCH // LEVEL3 + 1) * LEVEL3
    wheel: TimingWheel[int] = TimingWheel(start_ms=boundary - 2 * LEVEL3 + 1, cascade_budget=8)
    fire = {i: boundary + 1 + i * 7 for i in range(3_000)}
    for i, at in fire.items():
        wheel.insert(i, at)  # the slot after next: no stage yet, they wait in the ring
    assert wheel.cascades == 0
    assert wheel.advance(boundary) == []  # one jump: the slot's stage is done on entering
    assert wheel.cascades >= 3_000 - 255  # all moved (but those due in its first 256 ms)
    assert wheel.advance(boundary + 1 + 7 * 2_999) == list(range(3_000))


def test_a_jump_over_hours_moves_at_most_one_slot_of_what_is_not_due() -> None:
    """A worker that slept: the jump returns everything due, and moves down only the
    not-due timers of target's level-2 slot (65.5 s), plus one budget of pre-split."""
    wheel, boundary = loaded_across_level3(50_000, budget=512)
    fire = dict(wheel._pending)  # the model of what is loaded
    target = boundary + 10 * MINUTE + 1234
    slot2 = 1 << 16
    same_slot = [i for i, at in fire.items() if at > target and at // slot2 == target // slot2]
    before = wheel.cascades
    out = wheel.advance(target)
    assert out == sorted((i for i, at in fire.items() if at <= target), key=fire.__getitem__)
    assert wheel.cascades - before <= len(same_slot) + 512
    not_due = sum(1 for at in fire.values() if at > target)
    assert wheel.cascades - before < not_due // 10  # the old split moved all of them
    assert len(wheel) == not_due


def test_inserts_and_cancels_in_every_phase_of_a_chunked_move_keep_order() -> None:
    """Ties inserted before, during and after the slot's chunked move fire in insert order."""
    boundary = (EPOCH // LEVEL3 + 1) * LEVEL3
    wheel: TimingWheel[str] = TimingWheel(start_ms=boundary - 2 * LEVEL3 + 5, cascade_budget=8)
    tie = boundary + 3 * MINUTE
    early = [f"early-{i}" for i in range(40)]  # more than a stage moves at once (32)
    for name in early:  # in level 3's slot after next: no stage yet, they sit in the ring
        wheel.insert(name, tie)
    wheel.advance(boundary - LEVEL3 + 1)  # now that slot is the next: its source
    phases = []
    for k in range(24):  # calls a 25th of the slot apart: chunks of 8 steps come due
        wheel.insert(f"during-{k}", tie)
        if k % 4 == 1:
            assert wheel.cancel(f"during-{k - 1}")
        if k == 2:
            assert wheel.cancel("early-39") and wheel.cancel("early-0")
        stage = wheel._stages[3]
        phases.append((bool(wheel._slots[3][stage.digit]), bool(stage.mid), bool(stage.late)))
        wheel.advance(boundary - LEVEL3 + 1 + (k + 1) * (LEVEL3 // 25))
    assert (True, True, False) in phases or (True, True, True) in phases  # source -> mid
    assert any(mid and not source for source, mid, _ in phases)  # mid -> stage
    wheel.insert("after", tie)
    expected = [*early[1:39], *(f"during-{k}" for k in range(24) if k % 4 != 0), "after"]
    assert wheel.advance(tie) == expected


def test_a_runner_sleeping_until_next_expiry_never_enters_an_unprepared_slot() -> None:
    """With more work than one budget left, next_expiry asks for the calls that spread it."""
    boundary = (EPOCH // LEVEL3 + 1) * LEVEL3
    wheel: TimingWheel[int] = TimingWheel(start_ms=boundary - 2 * LEVEL3 + 1, cascade_budget=100)
    for i in range(5_000):  # in the slot after next: in the ring, not a stage
        wheel.insert(i, boundary + 1 + i)
    wheel.insert(-1, boundary - LEVEL3 + 10)  # wakes the runner in the slot before it
    assert wheel.advance(boundary - LEVEL3 + 10) == [-1]
    calls = 0
    while (at := wheel.next_expiry()) is not None and at < boundary:
        before = wheel.cascades
        assert wheel.advance(at) == []
        assert wheel.cascades - before <= 100
        calls += 1
    assert calls >= 5_000 * 2 // 100 // 2  # the work was spread, not left for the boundary
    assert wheel.pending_per_level()[3] == 5_000
    assert wheel._stage_work(wheel._stages[3]) <= 100  # what is left fits in one call
    before = wheel.cascades
    assert wheel.advance(boundary) == []
    assert wheel.cascades - before <= 100  # entering swapped rings; pacing took its share
    assert wheel.advance(boundary + 5_000) == list(range(5_000))


def test_pending_per_level_counts_prepared_timers_at_their_level() -> None:
    wheel: TimingWheel[int] = TimingWheel(start_ms=0, cascade_budget=1)
    for i in range(10):
        wheel.insert(i, LEVEL3 + 100 + i)  # the next level-3 slot: straight into its stage
    assert wheel.pending_per_level() == (0, 0, 0, 10, 0)
    assert wheel.cancel(3) and wheel.pending_per_level() == (0, 0, 0, 9, 0)
    assert wheel.next_expiry() == LEVEL3
    assert wheel.advance(LEVEL3) == [] and wheel.pending_per_level() == (9, 0, 0, 0, 0)


def test_cascade_budget_is_validated_by_name() -> None:
    with pytest.raises(ValueError, match="cascade_budget must be >= 1, got 0"):
        TimingWheel(cascade_budget=0)
    with pytest.raises(TypeError, match="cascade_budget must be an int, got float"):
        TimingWheel(cascade_budget=1.5)  # type: ignore[arg-type]
