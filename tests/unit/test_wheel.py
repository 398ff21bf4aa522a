"""TimingWheel: each documented behaviour, pinned by an example (no database, no clock)."""

from __future__ import annotations

import random
import weakref

import pytest

from durable.core.wheel import TimingWheel

MS, SECOND, MINUTE, HOUR, DAY = 1, 1_000, 60_000, 3_600_000, 86_400_000
YEAR = 365 * DAY
EPOCH = 1_700_000_000_123  # a real, unaligned instant: slot boundaries fall anywhere


class Token:
    """A hashable id that can be weakly referenced, to see when the wheel lets go of it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Token({self.name})"


def drain_by_expiry(wheel: TimingWheel[int], until: int) -> list[tuple[int, list[int]]]:
    """Run the wheel as a runner does: sleep until next_expiry(), advance, repeat."""
    wakeups = []
    while (at := wheel.next_expiry()) is not None and at <= until:
        wakeups.append((at, wheel.advance(at)))
    return wakeups


# -- construction ------------------------------------------------------------------------------


def test_default_shape_spans_256ms_to_34_years() -> None:
    wheel: TimingWheel[int] = TimingWheel()
    assert wheel.spans_ms == (256, 65_536, 16_777_216, 4_294_967_296, 1_099_511_627_776)
    assert round(wheel.spans_ms[1] / SECOND, 1) == 65.5
    assert round(wheel.spans_ms[2] / HOUR, 2) == 4.66
    assert round(wheel.spans_ms[3] / DAY, 1) == 49.7
    assert round(wheel.spans_ms[4] / YEAR, 1) == 34.9  # 34.8 in Julian years of 365.25 d
    assert wheel.time_ms == 0 and len(wheel) == 0 and wheel.next_expiry() is None


def test_shape_and_tick_are_configurable() -> None:
    wheel: TimingWheel[int] = TimingWheel(levels=3, slots=64, tick_ms=10, start_ms=EPOCH)
    assert wheel.spans_ms == (640, 40_960, 2_621_440)
    assert wheel.time_ms == EPOCH
    assert "levels=3 slots=64 tick_ms=10" in repr(wheel)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"slots": 100}, ValueError, "slots must be a power of two, got 100"),
        ({"slots": 1}, ValueError, "slots must be >= 2"),
        ({"levels": 0}, ValueError, "levels must be >= 1"),
        ({"tick_ms": 0}, ValueError, "tick_ms must be >= 1"),
        ({"start_ms": -1}, ValueError, "start_ms must be >= 0"),
        ({"levels": 2.0}, TypeError, "levels must be an int, got float"),
        ({"tick_ms": True}, TypeError, "tick_ms must be an int, got bool"),
    ],
)
def test_bad_settings_are_rejected_by_name(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        TimingWheel(**kwargs)


def test_bad_times_are_rejected_by_name() -> None:
    wheel: TimingWheel[int] = TimingWheel()
    with pytest.raises(TypeError, match="fire_at_ms must be an int of milliseconds, got float"):
        wheel.insert(1, 10.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="now_ms must be an int of milliseconds, got str"):
        wheel.advance("10")  # type: ignore[arg-type]
    assert len(wheel) == 0


# -- handles, duplicates, cancel ---------------------------------------------------------------


def test_insert_returns_the_id_as_handle_and_cancel_takes_it() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    handle = wheel.insert("invoice-42", EPOCH + 5 * MINUTE)
    assert handle == "invoice-42"
    assert "invoice-42" in wheel and len(wheel) == 1
    wheel.advance(EPOCH + 4 * MINUTE)  # the handle survives the timer moving down a level
    assert wheel.cancel(handle) is True
    assert handle not in wheel and len(wheel) == 0
    assert wheel.advance(EPOCH + 10 * MINUTE) == []


def test_inserting_a_pending_id_raises_and_changes_nothing() -> None:
    wheel: TimingWheel[int] = TimingWheel()
    wheel.insert(7, 100)
    with pytest.raises(ValueError, match="timer 7 is already pending; cancel it first"):
        wheel.insert(7, 50)
    assert len(wheel) == 1
    assert wheel.advance(99) == []
    assert wheel.advance(100) == [7]


def test_cancel_reports_whether_it_cancelled() -> None:
    wheel: TimingWheel[int] = TimingWheel()
    wheel.insert(1, 10)
    wheel.insert(2, 10)
    assert wheel.cancel(1) is True
    assert wheel.cancel(1) is False  # twice
    assert wheel.cancel(99) is False  # never inserted
    assert wheel.advance(10) == [2]
    assert wheel.cancel(2) is False  # after it fired


def test_an_id_can_be_inserted_again_after_it_fired_or_was_cancelled() -> None:
    wheel: TimingWheel[int] = TimingWheel()
    wheel.insert(1, 10)
    assert wheel.advance(10) == [1]
    wheel.insert(1, 20)
    assert wheel.cancel(1) is True
    wheel.insert(1, 30)
    assert wheel.advance(29) == []
    assert wheel.advance(30) == [1]


def test_ids_can_be_any_hashable() -> None:
    wheel: TimingWheel[object] = TimingWheel()
    wheel.insert(("shard", 3), 5)
    wheel.insert("cron:daily:1700000000000", 5)
    wheel.insert(None, 6)
    assert wheel.advance(6) == [("shard", 3), "cron:daily:1700000000000", None]


def test_cancel_and_fire_release_the_id_at_once() -> None:
    wheel: TimingWheel[Token] = TimingWheel(start_ms=EPOCH)
    cancelled, fired = Token("cancelled"), Token("fired")
    wheel.insert(cancelled, EPOCH + 30 * DAY)
    wheel.insert(fired, EPOCH + 1)
    refs = weakref.ref(cancelled), weakref.ref(fired)
    assert wheel.cancel(cancelled)
    assert wheel.advance(EPOCH + 1) == [fired]
    del cancelled, fired
    assert [ref() for ref in refs] == [None, None]  # no tombstone kept them alive
    assert wheel.pending_per_level() == (0, 0, 0, 0, 0)


# -- never early, overdue, time --------------------------------------------------------------


@pytest.mark.parametrize("delay", [1, 255, 256, 257, 65_535, 65_536, HOUR, 30 * DAY, 40 * YEAR])
def test_never_early_and_never_late(delay: int) -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("t", EPOCH + delay)
    assert wheel.advance(EPOCH + delay - 1) == []
    assert wheel.advance(EPOCH + delay) == ["t"]


def test_a_timer_fires_at_its_ms_whatever_steps_the_runner_takes() -> None:
    rnd = random.Random(7)
    fire_at = EPOCH + 3 * HOUR + 12_345
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("t", fire_at)
    now = EPOCH
    while now < fire_at - 1:
        now = min(fire_at - 1, now + rnd.choice([1, 7, 300, 70_000, 20 * MINUTE]))
        assert wheel.advance(now) == []
    assert wheel.advance(fire_at) == ["t"]


def test_an_overdue_insert_is_due_on_the_next_advance_and_comes_first() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=1_000)
    wheel.insert("soon", 1_005)
    wheel.insert("late", 990)
    wheel.insert("now", 1_000)
    assert wheel.pending_overdue() == 2
    assert wheel.next_expiry() == 1_000
    assert wheel.advance(1_010) == ["late", "now", "soon"]


def test_advance_into_the_past_moves_nothing() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=1_000)
    wheel.insert("next", 1_001)
    assert wheel.advance(500) == []
    assert wheel.time_ms == 1_000
    wheel.insert("overdue", 900)
    assert wheel.advance(999) == ["overdue"]  # overdue inserts are due whatever now says
    assert wheel.advance(1_001) == ["next"]


def test_tick_larger_than_a_ms_rounds_up_and_keeps_ms_order() -> None:
    wheel: TimingWheel[str] = TimingWheel(tick_ms=10)
    wheel.insert("c", 19)
    wheel.insert("a", 11)
    wheel.insert("b", 15)
    wheel.insert("d", 20)
    assert wheel.advance(11) == []  # a tick spans 11..20: due only once it has all passed
    assert wheel.advance(19) == []
    assert wheel.advance(20) == ["a", "b", "c", "d"]
    wheel.insert("e", 25)
    assert wheel.advance(26) == []  # inside the current tick: waits for its end
    wheel.insert("f", 22)  # not overdue either: same tick as "e", so order holds
    assert wheel.advance(30) == ["f", "e"]


# -- order -------------------------------------------------------------------------------------


def test_one_call_returns_ids_in_fire_time_order() -> None:
    rnd = random.Random(3)
    wheel: TimingWheel[int] = TimingWheel(start_ms=EPOCH)
    fire = {i: EPOCH + rnd.randrange(1, 90 * DAY) for i in range(5_000)}
    for i, at in fire.items():
        wheel.insert(i, at)
    out = wheel.advance(EPOCH + 90 * DAY)
    assert out == sorted(fire, key=lambda i: (fire[i], i))


def test_calls_in_small_steps_keep_fire_time_order() -> None:
    rnd = random.Random(4)
    wheel: TimingWheel[int] = TimingWheel(start_ms=EPOCH)
    fire = {i: EPOCH + rnd.randrange(1, 2 * SECOND) for i in range(3_000)}
    for i, at in fire.items():
        wheel.insert(i, at)
    out: list[int] = []
    for now in range(EPOCH + 1, EPOCH + 2 * SECOND + 1, 3):
        batch = wheel.advance(now)
        assert all(fire[i] <= now for i in batch)
        out += batch
    assert out == sorted(fire, key=lambda i: (fire[i], i))


def test_ties_come_out_in_insertion_order_even_across_levels() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    due = EPOCH + 10 * DAY
    wheel.insert("first, placed high", due)
    wheel.advance(due - 5 * MINUTE)
    wheel.insert("second, placed lower", due)
    wheel.insert("third", due)
    wheel.advance(due - 100)
    wheel.insert("fourth, placed at level 0", due)
    wheel.cancel("second, placed lower")
    wheel.insert("second, placed lower", due)  # re-inserted: now the latest
    assert wheel.advance(due) == [
        "first, placed high",
        "third",
        "fourth, placed at level 0",
        "second, placed lower",
    ]


# -- next_expiry -------------------------------------------------------------------------------


def test_next_expiry_is_exact_at_level_zero_and_a_lower_bound_above() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("far", EPOCH + 2 * HOUR)
    expiry = wheel.next_expiry()
    assert expiry is not None and EPOCH < expiry <= EPOCH + 2 * HOUR
    wheel.insert("near", EPOCH + 3)
    assert wheel.next_expiry() == EPOCH + 3


def test_a_runner_sleeping_until_next_expiry_fires_each_timer_on_its_ms() -> None:
    rnd = random.Random(5)
    wheel: TimingWheel[int] = TimingWheel(start_ms=EPOCH)
    fire = {i: EPOCH + rnd.randrange(1, 60 * DAY) for i in range(300)}
    for i, at in fire.items():
        wheel.insert(i, at)
    for at, batch in drain_by_expiry(wheel, EPOCH + 61 * DAY):
        assert all(fire[i] == at for i in batch)  # woken exactly when due, never late
    assert len(wheel) == 0 and wheel.next_expiry() is None


# -- cascades and idle time --------------------------------------------------------------------


def test_a_30_day_timer_moves_down_at_most_4_times() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("t", EPOCH + 30 * DAY + 12_345)
    wakeups = drain_by_expiry(wheel, EPOCH + 31 * DAY)
    assert wakeups[-1] == (EPOCH + 30 * DAY + 12_345, ["t"])
    assert len(wakeups) <= 5
    assert 1 <= wheel.cascades <= 4


def test_timers_move_down_at_most_levels_minus_one_times_whatever_the_steps() -> None:
    rnd = random.Random(6)
    wheel: TimingWheel[int] = TimingWheel(start_ms=EPOCH)
    for i in range(2_000):
        wheel.insert(i, EPOCH + rnd.randrange(1, 45 * DAY))
    now, fired = EPOCH, 0
    while len(wheel):
        now += rnd.choice([1, 10, 1_000, MINUTE, HOUR, DAY])
        fired += len(wheel.advance(now))
    assert fired == 2_000
    assert wheel.cascades <= 4 * 2_000


def test_30_idle_days_cost_a_handful_of_slot_visits() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("t", EPOCH + 30 * DAY + 1)
    assert wheel.advance(EPOCH + 30 * DAY) == []
    assert wheel.slot_visits <= 2
    assert wheel.advance(EPOCH + 30 * DAY + 1) == ["t"]
    assert wheel.slot_visits <= 3


def test_30_idle_days_in_one_minute_steps_visit_only_occupied_slots() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("t", EPOCH + 30 * DAY + 1)
    for now in range(EPOCH + MINUTE, EPOCH + 30 * DAY + 1, MINUTE):  # 43,200 wake-ups
        assert wheel.advance(now) == []
    assert wheel.advance(EPOCH + 30 * DAY + 1) == ["t"]
    assert wheel.slot_visits <= 5  # one per level the timer passes through


def test_pending_counts_per_level_and_overflow() -> None:
    wheel: TimingWheel[str] = TimingWheel()
    for name, delay in [
        ("10 ms", 10),
        ("10 s", 10 * SECOND),
        ("1 h", HOUR),
        ("10 d", 10 * DAY),
        ("10 y", 10 * YEAR),
        ("40 y", 40 * YEAR),
        ("100 y", 100 * YEAR),
    ]:
        wheel.insert(name, delay)
    assert wheel.pending_per_level() == (1, 1, 1, 1, 1)
    assert wheel.pending_overflow() == 2
    assert len(wheel) == 7


def test_overflow_timers_come_back_in_and_fire_on_their_ms() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("40 y", EPOCH + 40 * YEAR)
    wheel.insert("100 y", EPOCH + 100 * YEAR)
    wheel.insert("gone", EPOCH + 50 * YEAR)
    assert wheel.cancel("gone")
    assert wheel.advance(EPOCH + 40 * YEAR - 1) == []
    assert wheel.advance(EPOCH + 40 * YEAR) == ["40 y"]
    assert wheel.advance(EPOCH + 100 * YEAR - 1) == []
    assert wheel.advance(EPOCH + 100 * YEAR) == ["100 y"]
    assert wheel.overflow_reentries >= 1


def test_next_expiry_forgets_a_cancelled_overflow_timer() -> None:
    wheel: TimingWheel[str] = TimingWheel(start_ms=EPOCH)
    wheel.insert("40 y", EPOCH + 40 * YEAR)
    wheel.insert("100 y", EPOCH + 100 * YEAR)
    expiry = wheel.next_expiry()
    assert expiry is not None and expiry <= EPOCH + 40 * YEAR
    wheel.cancel("40 y")
    expiry = wheel.next_expiry()  # the start of 100 y's 34.8-year block, no sooner
    assert expiry is not None and EPOCH + 65 * YEAR < expiry <= EPOCH + 100 * YEAR


def test_a_tiny_wheel_leans_on_its_overflow_and_stays_exact() -> None:
    rnd = random.Random(8)
    wheel: TimingWheel[int] = TimingWheel(levels=2, slots=4)  # rings span 4 and 16 ms
    fire = {i: rnd.randrange(1, 10_000) for i in range(500)}
    for i, at in fire.items():
        wheel.insert(i, at)
    assert wheel.pending_overflow() > 400
    out: list[int] = []
    for now in [*range(0, 10_000, 37), 10_000]:
        out += wheel.advance(now)
    assert out == sorted(fire, key=lambda i: (fire[i], i))


def test_same_inputs_same_outputs() -> None:
    def run() -> list[list[int]]:
        rnd = random.Random(9)
        wheel: TimingWheel[int] = TimingWheel(start_ms=EPOCH)
        for i in range(1_000):
            wheel.insert(i, EPOCH + rnd.randrange(1, DAY))
        return [wheel.advance(EPOCH + k * HOUR) for k in range(1, 25)]

    assert run() == run()
