"""durable.core.ratelimit: parsing rates, and the sliding window over a key's log."""

from __future__ import annotations

import pytest

from durable.core.ratelimit import MAX_COUNT, parse_rate


@pytest.mark.parametrize(
    ("text", "count", "period_ms"),
    [("100/m", 100, 60_000), ("10/s", 10, 1_000), (" 3/h ", 3, 3_600_000)],
)
def test_rates_parse(text, count, period_ms):
    rate = parse_rate(text)
    assert (rate.count, rate.period_ms, rate.text) == (count, period_ms, text.strip())


@pytest.mark.parametrize(
    ("text", "error", "message"),
    [
        ("10/d", ValueError, "N/s, N/m or N/h"),
        ("ten/s", ValueError, "N/s, N/m or N/h"),
        ("10", ValueError, "N/s, N/m or N/h"),
        ("0/s", ValueError, "N must be 1"),
        (f"{MAX_COUNT + 1}/s", ValueError, "N must be 1"),
        (10, TypeError, "expected a str"),
    ],
)
def test_bad_rates_are_refused_with_the_reason(text, error, message):
    with pytest.raises(error, match=message):
        parse_rate(text)


def test_the_window_holds_over_every_window_not_just_on_average():
    rate = parse_rate("3/s")
    log: list[int] = []
    for at in (0, 0, 0):
        assert rate.room(log, at) > 0
        log = rate.record(log, at)
    assert rate.room(log, 999) == 0, "a token bucket's refill would let a 4th in here"
    assert rate.next_ms(log) == 1_000
    assert rate.room(log, 1_000) == 3
    log = rate.record(log, 1_000)
    assert log == [0, 0, 1_000], "only the last N starts are kept"


def test_the_log_forgets_starts_older_than_two_periods():
    # Written back by every batch that starts one: a key far under its rate keeps only
    # what can still count, not its last N starts (bench/concurrency.py: 200 → ~80).
    rate = parse_rate("200/s")
    log: list[int] = []
    for at in range(0, 10_000, 25):  # 40 starts a second
        log = rate.record(log, at)
    assert log[0] > 9_975 - 2_000
    assert len(log) == 80


def test_forgetting_old_starts_changes_no_decision():
    # The same decisions as a log of the last N starts, for clocks up to a period behind.
    import random

    rng = random.Random(7)
    for text in ("3/s", "5/m", "50/s"):
        rate = parse_rate(text)
        full: list[int] = []
        pruned: list[int] = []
        now = 0
        for _ in range(2_000):
            now += rng.randrange(0, rate.period_ms // 2)
            for at in (now, now - rng.randrange(0, rate.period_ms + 1)):
                assert rate.room(pruned, at) == rate.room(full, at)
                if rate.room(full, at) == 0:
                    assert rate.next_ms(pruned) == rate.next_ms(full)
            if rate.room(full, now) > 0:
                full = [*full, now][-rate.count :]
                pruned = rate.record(pruned, now)
