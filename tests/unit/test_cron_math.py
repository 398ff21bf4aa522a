"""Calendar math and the catch-up/overlap decision, pure (no database, no Django clock).

Instants are fed by hand, the way a manual clock would: DST transitions of 2026 in
Europe/Paris (29 March 02:00 -> 03:00, 25 October 03:00 -> 02:00) and America/New_York
(8 March, 1 November).
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from durable.core import cron
from durable.core.catchup import FIRE_ALL_CAP, Policy, decide
from durable.core.cron import CronRecurrence, IntervalRecurrence, to_ms

PARIS = ZoneInfo("Europe/Paris")
NEW_YORK = ZoneInfo("America/New_York")
S = 1_000
MIN = 60 * S
HOUR = 60 * MIN


def utc(*args: int) -> int:
    return to_ms(datetime(*args, tzinfo=UTC))


def local(ms: int, tz: ZoneInfo) -> str:
    return (
        cron.ms_to_wall(ms, tz).strftime("%m-%d %H:%M")
        + " "
        + (datetime.fromtimestamp(ms / 1000, UTC).astimezone(tz).tzname() or "")
    )


def take(rec, after_ms: int, n: int) -> list[int]:
    out = []
    for found in rec.iter_after(after_ms):
        out.append(found)
        if len(out) == n:
            return out
    return out


# -- daylight saving time ------------------------------------------------------------


@pytest.mark.parametrize(
    ("tz", "two_days_before", "fires_at_utc", "local_times"),
    [
        (
            PARIS,
            utc(2026, 3, 27, 12),
            utc(2026, 3, 29, 1, 0),
            ["03-28 02:30 CET", "03-29 03:00 CEST", "03-30 02:30 CEST"],
        ),
        (
            NEW_YORK,
            utc(2026, 3, 6, 12),
            utc(2026, 3, 8, 7, 0),
            ["03-07 02:30 EST", "03-08 03:00 EDT", "03-09 02:30 EDT"],
        ),
    ],
)
def test_spring_forward_a_skipped_time_fires_once_at_the_end_of_the_gap(
    tz, two_days_before, fires_at_utc, local_times
):
    rec = CronRecurrence("30 2 * * *", tz.key)
    before, on_the_day, after = take(rec, two_days_before, 3)
    assert on_the_day == fires_at_utc
    assert [local(ms, tz) for ms in (before, on_the_day, after)] == local_times
    assert on_the_day - before == 23 * HOUR + 30 * MIN  # 02:30 -> 03:00 on a 23-hour day
    assert after - on_the_day == 23 * HOUR + 30 * MIN  # 03:00 -> 02:30 the next day


@pytest.mark.parametrize(
    ("expression", "tz", "day_before", "fires_at_local", "gap_h"),
    [
        # Paris repeats 02:00-03:00 (03:00 CEST -> 02:00 CET): 02:30 happens twice.
        ("30 2 * * *", PARIS, utc(2026, 10, 24, 12), "10-25 02:30 CEST", 25),
        # New York repeats 01:00-02:00 (02:00 EDT -> 01:00 EST): 01:30 happens twice...
        ("30 1 * * *", NEW_YORK, utc(2026, 10, 31, 12), "11-01 01:30 EDT", 25),
        # ... while 02:30 happens once, in EST.
        ("30 2 * * *", NEW_YORK, utc(2026, 10, 31, 12), "11-01 02:30 EST", 24),
    ],
)
def test_fall_back_a_repeated_time_fires_once_at_its_first_occurrence(
    expression, tz, day_before, fires_at_local, gap_h
):
    rec = CronRecurrence(expression, tz.key)
    on_the_day, next_day = take(rec, day_before, 2)
    assert local(on_the_day, tz) == fires_at_local
    assert next_day - on_the_day == gap_h * HOUR  # not twice: the next one is tomorrow's


def test_an_hourly_schedule_follows_elapsed_time_across_both_transitions():
    rec = CronRecurrence("0 * * * *", "Europe/Paris")
    spring_day = take(rec, utc(2026, 3, 28, 23) - 1, 30)
    assert [b - a for a, b in itertools.pairwise(spring_day)] == [HOUR] * 29
    assert rec.count(utc(2026, 3, 28, 23), utc(2026, 3, 29, 22) - 1, 100) == 23
    assert rec.count(utc(2026, 10, 24, 22), utc(2026, 10, 25, 23) - 1, 100) == 25


def test_every_quarter_of_the_two_oclock_hour_on_dst_days():
    # The minute field starts with "*": a wildcard job in Vixie cron's sense, which
    # follows the clock as it runs rather than the wall time it names.
    rec = CronRecurrence("*/15 2 * * *", "Europe/Paris")
    # Spring: 02:00..02:45 do not exist, so none of them fires that day.
    assert [local(ms, PARIS) for ms in take(rec, utc(2026, 3, 28, 12), 2)] == [
        "03-30 02:00 CEST",
        "03-30 02:15 CEST",
    ]
    # Autumn: the hour repeats, and each quarter fires in both passes.
    autumn = take(rec, utc(2026, 10, 24, 12), 9)
    assert [local(ms, PARIS) for ms in autumn] == [
        *(f"10-25 02:{m:02} CEST" for m in (0, 15, 30, 45)),
        *(f"10-25 02:{m:02} CET" for m in (0, 15, 30, 45)),
        "10-26 02:00 CET",
    ]


# Paris 2030: spring forward Sunday 31 March at 01:00 UTC (02:00 CET -> 03:00 CEST), fall
# back Sunday 27 October at 01:00 UTC (03:00 CEST -> 02:00 CET).
@pytest.mark.parametrize(
    ("expression", "after", "expected"),
    [
        # Wildcards (minute or hour field starting with "*") follow the running clock.
        (
            "*/30 * * * *",
            utc(2030, 3, 30, 23, 59),
            ["03-31 01:00 CET", "03-31 01:30 CET", "03-31 03:00 CEST", "03-31 03:30 CEST"],
        ),
        (
            "*/30 * * * *",
            utc(2030, 10, 26, 23, 59),
            [
                "10-27 02:00 CEST",
                "10-27 02:30 CEST",
                "10-27 02:00 CET",
                "10-27 02:30 CET",
                "10-27 03:00 CET",
            ],
        ),
        (
            "0 */2 * * *",
            utc(2030, 3, 30, 22, 59),
            ["03-31 00:00 CET", "03-31 04:00 CEST", "03-31 06:00 CEST"],  # no 02:00 that day
        ),
        (
            "0 */2 * * *",
            utc(2030, 10, 26, 21, 59),
            ["10-27 00:00 CEST", "10-27 02:00 CEST", "10-27 02:00 CET", "10-27 04:00 CET"],
        ),
        # A fixed time of day fires once a day: at the end of the gap, or at its first pass.
        ("30 2 * * *", utc(2030, 3, 30, 12), ["03-31 03:00 CEST", "04-01 02:30 CEST"]),
        ("30 2 * * *", utc(2030, 10, 26, 12), ["10-27 02:30 CEST", "10-28 02:30 CET"]),
    ],
)
def test_vixie_dst_rules_for_wildcard_and_fixed_expressions(expression, after, expected):
    rec = CronRecurrence(expression, "Europe/Paris")
    fired = take(rec, after, len(expected))
    assert [local(ms, PARIS) for ms in fired] == expected
    # The same instants backwards: what catch-up decisions walk.
    backward = []
    for found in rec.iter_before(fired[-1]):
        if found <= after:
            break
        backward.append(found)
    assert backward[::-1] == fired


def test_wildcard_elapsed_time_on_the_two_paris_dst_days_of_2030():
    every_half_hour = CronRecurrence("*/30 * * * *", "Europe/Paris")
    two_hourly = CronRecurrence("0 */2 * * *", "Europe/Paris")
    short_day = (utc(2030, 3, 30, 23), utc(2030, 3, 31, 22) - 1)  # 23 hours
    long_day = (utc(2030, 10, 26, 22), utc(2030, 10, 27, 23) - 1)  # 25 hours
    assert every_half_hour.count(*short_day, 1000) == 46
    assert every_half_hour.count(*long_day, 1000) == 50
    assert two_hourly.count(*short_day, 1000) == 11  # 02:00 does not exist
    assert two_hourly.count(*long_day, 1000) == 13  # 02:00 twice


# -- day of month and day of week (Vixie cron's rule) --------------------------------


def _days(expression: str, n: int) -> list[str]:
    rec = CronRecurrence(expression, "UTC")
    return [
        datetime.fromtimestamp(ms / 1000, UTC).strftime("%a %m-%d %H:%M")
        for ms in take(rec, utc(2030, 1, 1), n)
    ]


def test_a_stepped_day_of_month_and_a_weekday_must_both_match():
    # "*/2" starts with "*": AND, as Vixie cron and cronie do. croniter's own default
    # would OR them and fire on every odd day plus every Monday.
    assert _days("0 12 */2 * 1", 4) == [
        "Mon 01-07 12:00",
        "Mon 01-21 12:00",
        "Mon 02-11 12:00",
        "Mon 02-25 12:00",
    ]
    assert not cron.day_or("0 12 */2 * 1")


def test_two_restricted_day_fields_fire_on_either():
    assert _days("0 12 1 * 1", 6) == [
        "Tue 01-01 12:00",
        "Mon 01-07 12:00",
        "Mon 01-14 12:00",
        "Mon 01-21 12:00",
        "Mon 01-28 12:00",
        "Fri 02-01 12:00",
    ]
    assert cron.day_or("0 12 1 * 1")


def test_one_starred_day_field_leaves_the_other_alone():
    assert _days("0 12 * * 1", 3) == ["Mon 01-07 12:00", "Mon 01-14 12:00", "Mon 01-21 12:00"]
    assert _days("0 12 1,15 * *", 3) == ["Tue 01-01 12:00", "Tue 01-15 12:00", "Fri 02-01 12:00"]
    assert not cron.day_or("0 12 * * 1") and not cron.day_or("0 12 1,15 * *")


def test_an_and_of_days_that_never_meet_is_refused():
    # The 30th of February on a Monday: never, whatever the weekday rule.
    with pytest.raises(ValueError, match="never matches"):
        cron.check_expression("0 0 30 2 *")
    assert cron.check_expression("0 0 */30 2 mon") == "0 0 */30 2 mon"  # 1 Feb on a Monday


def test_interval_keeps_a_fixed_utc_cadence_across_dst():
    rec = IntervalRecurrence(10 * MIN)
    for start in (utc(2026, 3, 29, 0, 30), utc(2026, 10, 25, 0, 30)):
        fires = take(rec, start, 12)
        assert {b - a for a, b in itertools.pairwise(fires)} == {10 * MIN}


def test_interval_anchor_and_arithmetic():
    rec = IntervalRecurrence(90 * S, anchor_ms=utc(2026, 1, 1, 0, 0, 30))
    assert rec.next_after(utc(2026, 1, 1, 0, 0, 30)) == utc(2026, 1, 1, 0, 2)
    assert rec.latest_at_or_before(utc(2026, 1, 1, 0, 2)) == utc(2026, 1, 1, 0, 2)
    assert rec.latest_at_or_before(utc(2026, 1, 1, 0, 2) - 1) == utc(2026, 1, 1, 0, 0, 30)
    assert rec.count(utc(2026, 1, 1), utc(2026, 1, 1, 1), 10_000) == 40
    assert rec.count(utc(2026, 1, 1), utc(2026, 1, 1, 1), 7) == 7
    with pytest.raises(ValueError, match="at least 1 second"):
        IntervalRecurrence(999)


EXPRESSIONS = [
    "30 2 * * *",
    "0 * * * *",
    "*/20 1-3 * * *",
    "0 9 * * mon-fri",
    "15 3 L * *",
    "0 */2 * * *",
    "0 12 */2 * 1",
    "0 12 1 * 1",
]
ZONES = ["Europe/Paris", "America/New_York", "Australia/Lord_Howe", "UTC", "Asia/Kolkata"]
YEAR_2026 = (utc(2026, 1, 1), utc(2027, 1, 1))


@settings(max_examples=150, deadline=None)
@given(
    expression=st.sampled_from(EXPRESSIONS),
    tz=st.sampled_from(ZONES),
    start=st.integers(*YEAR_2026),
    span=st.integers(0, 3 * 24 * HOUR),
)
def test_forward_and_backward_iteration_agree(expression, tz, start, span):
    rec = CronRecurrence(expression, tz)
    forward = []
    for found in rec.iter_after(start):
        if found > start + span:
            break
        forward.append(found)
    backward = []
    for found in rec.iter_before(start + span):
        if found <= start:
            break
        backward.append(found)
    assert forward == sorted(set(forward)), "not strictly increasing"
    assert forward == backward[::-1]
    assert rec.count(start + 1, start + span, 10_000) == len(forward)
    nxt = rec.next_after(start)
    assert nxt > start and rec.latest_at_or_before(nxt) == nxt
    assert rec.latest_at_or_before(nxt - 1) is None or rec.latest_at_or_before(nxt - 1) <= start


# -- expressions and helpers ---------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("61 * * * *", "out of range"),
        ("0 9 * *", "expected 5 fields"),
        ("0 0 30 2 *", "never matches"),
        ("@reboot", "unknown macro"),
        ("", "non-empty"),
        ("*/0 * * * *", "step"),
    ],
)
def test_invalid_expressions_say_why(expression, reason):
    with pytest.raises(ValueError, match=reason):
        cron.check_expression(expression)


def test_macros_and_whitespace_are_normalized():
    assert cron.check_expression("@daily") == "0 0 * * *"
    assert cron.check_expression("  0   9 * *  mon-fri ") == "0 9 * * mon-fri"
    assert cron.check_expression("*/10 * * * * 30") == "*/10 * * * * 30"  # seconds last


def test_unknown_time_zone():
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        cron.zone("Mars/Olympus")
    with pytest.raises(ValueError, match="unknown time zone"):
        CronRecurrence("0 9 * * *", "../etc/passwd")


def test_helper_expressions():
    assert cron.hourly_expression(15) == "15 * * * *"
    assert cron.daily_expression("09:05") == "5 9 * * *"
    assert cron.daily_expression(time(23, 59)) == "59 23 * * *"
    assert cron.weekly_expression("mon-fri", "08:30") == "30 8 * * mon-fri"
    assert cron.monthly_expression(31, "06:00") == "0 6 31 * *"
    assert cron.monthly_expression("last") == "0 0 L * *"
    for bad, call in [
        ("at", lambda: cron.daily_expression("9am")),
        ("at", lambda: cron.daily_expression("24:00")),
        ("on", lambda: cron.weekly_expression("funday")),
        ("day", lambda: cron.monthly_expression(0)),
        ("minute", lambda: cron.hourly_expression(60)),
    ]:
        with pytest.raises(ValueError, match=bad):
            call()


# -- the decision ----------------------------------------------------------------------

EVERY_MINUTE = IntervalRecurrence(MIN)
T0 = utc(2026, 5, 1, 12)  # an occurrence of EVERY_MINUTE


def ran(decision):
    return [(run.occurrence_ms, run.catch_up) for run in decision.runs]


def test_on_time_and_slightly_late_occurrences_run():
    for now in (T0, T0 + 5 * S, T0 + 59 * S):
        decision = decide(EVERY_MINUTE, Policy(), scheduled_ms=T0, now_ms=now)
        assert ran(decision) == [(T0, False)] and decision.reason == "on_time"
        assert decision.next_ms == T0 + MIN and decision.skipped == 0


def test_late_beyond_grace_is_missed_even_without_a_later_occurrence():
    hourly = IntervalRecurrence(HOUR)
    decision = decide(hourly, Policy(catch_up="skip"), scheduled_ms=T0, now_ms=T0 + 90 * S)
    assert ran(decision) == [] and decision.skipped == 1 and decision.next_ms == T0 + HOUR
    decision = decide(
        hourly, Policy(catch_up="skip", grace_ms=2 * MIN), scheduled_ms=T0, now_ms=T0 + 90 * S
    )
    assert ran(decision) == [(T0, False)] and decision.reason == "on_time"


# Down from just after T0 - 1 min until T0 + 2 min 30 s: T0, T0+1, T0+2 were missed.
DOWN_UNTIL = T0 + 2 * MIN + 30 * S


def test_skip_policy_after_downtime():
    strict = decide(
        EVERY_MINUTE, Policy(catch_up="skip", grace_ms=10 * S), scheduled_ms=T0, now_ms=DOWN_UNTIL
    )
    # The latest (30 s late) is missed too: nothing runs.
    assert (ran(strict), strict.skipped, strict.next_ms) == ([], 3, T0 + 3 * MIN)
    lenient = decide(EVERY_MINUTE, Policy(catch_up="skip"), scheduled_ms=T0, now_ms=DOWN_UNTIL)
    # The latest is within a minute of grace: it runs on time; the two before are dropped.
    assert (ran(lenient), lenient.skipped) == ([(T0 + 2 * MIN, False)], 2)


def test_fire_once_runs_the_latest_missed_with_catch_up():
    policy = Policy(catch_up="fire_once", grace_ms=10 * S)
    decision = decide(EVERY_MINUTE, policy, scheduled_ms=T0, now_ms=DOWN_UNTIL)
    assert ran(decision) == [(T0 + 2 * MIN, True)] and decision.runs[0].missed == 3
    assert decision.skipped == 2 and decision.next_ms == T0 + 3 * MIN
    # With the latest within grace, it runs on time right after the catch-up run.
    decision = decide(EVERY_MINUTE, Policy(), scheduled_ms=T0, now_ms=DOWN_UNTIL)
    assert ran(decision) == [(T0 + MIN, True), (T0 + 2 * MIN, False)]
    assert decision.skipped == 1 and decision.next_ms == T0 + 3 * MIN


def follow(rec, policy, decision, now):
    """Fire the decided backlog timers one after the other; return every run."""
    runs = ran(decision)
    while decision.next_catch_up:
        now += S
        decision = decide(
            rec,
            policy,
            scheduled_ms=decision.next_ms,
            now_ms=now,
            until_ms=decision.until_ms,
            then_ms=decision.then_ms,
        )
        assert decision.backlog
        runs += ran(decision)
    return runs, decision


def test_fire_all_runs_every_missed_occurrence_oldest_first():
    policy = Policy(catch_up="fire_all", grace_ms=10 * S)
    first = decide(EVERY_MINUTE, policy, scheduled_ms=T0, now_ms=DOWN_UNTIL)
    runs, last = follow(EVERY_MINUTE, policy, first, DOWN_UNTIL)
    assert runs == [(T0, True), (T0 + MIN, True), (T0 + 2 * MIN, True)]
    assert last.next_ms == T0 + 3 * MIN and first.skipped == 0
    # Within grace, the latest runs on time after the backlog, without being judged again.
    policy = Policy(catch_up="fire_all")
    runs, last = follow(
        EVERY_MINUTE,
        policy,
        decide(EVERY_MINUTE, policy, scheduled_ms=T0, now_ms=DOWN_UNTIL),
        DOWN_UNTIL + 5 * MIN,
    )
    assert runs == [(T0, True), (T0 + MIN, True), (T0 + 2 * MIN, False)]
    assert last.next_ms == T0 + 3 * MIN


def test_fire_all_keeps_the_newest_thousand_and_counts_the_rest_as_skipped():
    every_second = IntervalRecurrence(S)
    policy = Policy(catch_up="fire_all", grace_ms=0)
    now = T0 + 1_500 * S + 500
    decision = decide(every_second, policy, scheduled_ms=T0, now_ms=now)
    assert decision.runs[0].missed == 1_501 and decision.skipped == 1_501 - FIRE_ALL_CAP
    assert ran(decision) == [(T0 + (1_501 - FIRE_ALL_CAP) * S, True)]
    assert decision.until_ms == T0 + 1_500 * S and decision.next_catch_up is True
    runs, _ = follow(every_second, policy, decision, now)
    assert len(runs) == FIRE_ALL_CAP and runs[-1] == (T0 + 1_500 * S, True)


def test_overlap_skip_and_queue():
    every_second = IntervalRecurrence(S)
    # The run of T0 started at T0 and took 2.5 s: T0+1 and T0+2 came due meanwhile.
    busy = {"busy_since_ms": T0, "busy_until_ms": T0 + 2_500}
    skip = decide(every_second, Policy(), scheduled_ms=T0 + S, now_ms=T0 + 2_510, **busy)
    assert (ran(skip), skip.skipped, skip.next_ms, skip.reason) == ([], 2, T0 + 3 * S, "overlap")
    queue = decide(
        every_second, Policy(overlap="queue"), scheduled_ms=T0 + S, now_ms=T0 + 2_510, **busy
    )
    assert (ran(queue), queue.skipped, queue.next_ms) == ([(T0 + 2 * S, False)], 1, T0 + 3 * S)
    # Fired later, after T0+3 came due with nothing running: queued run, then the on-time one.
    later = decide(
        every_second, Policy(overlap="queue"), scheduled_ms=T0 + S, now_ms=T0 + 3_200, **busy
    )
    assert ran(later) == [(T0 + 2 * S, False), (T0 + 3 * S, False)]
    assert (later.skipped, later.next_ms) == (1, T0 + 4 * S)


def test_after_an_overlap_a_late_fire_is_judged_as_missed():
    every_second = IntervalRecurrence(S)
    busy = {"busy_since_ms": T0, "busy_until_ms": T0 + 1_500}
    decision = decide(
        every_second,
        Policy(catch_up="skip", grace_ms=0),
        scheduled_ms=T0 + S,
        now_ms=T0 + 4_200,
        **busy,
    )
    # T0+1 overlapped (skipped); T0+2..T0+4 came due after the run: missed, skipped too.
    assert ran(decision) == [] and decision.skipped == 4 and decision.next_ms == T0 + 5 * S


def test_policies_are_validated():
    with pytest.raises(ValueError, match="catch_up: expected one of skip, fire_once, fire_all"):
        Policy(catch_up="latest")
    with pytest.raises(ValueError, match="overlap"):
        Policy(overlap="allow")
    with pytest.raises(ValueError, match="grace"):
        Policy(grace_ms=-1)


def test_dst_through_the_decision_never_runs_an_occurrence_twice():
    rec = CronRecurrence("30 2 * * *", "Europe/Paris")
    occurrence = rec.next_after(utc(2026, 10, 24, 12))
    fired = []
    for _ in range(3):
        decision = decide(rec, Policy(), scheduled_ms=occurrence, now_ms=occurrence)
        fired += [run.occurrence_ms for run in decision.runs]
        occurrence = decision.next_ms
    assert [local(ms, PARIS) for ms in fired] == [
        "10-25 02:30 CEST",
        "10-26 02:30 CET",
        "10-27 02:30 CET",
    ]


def test_a_day_without_the_wall_time_is_not_skipped_in_a_southern_zone():
    # Lord Howe moves by 30 minutes: 02:00 -> 02:30 on 4 October 2026.
    rec = CronRecurrence("15 2 * * *", "Australia/Lord_Howe")
    fired = take(rec, utc(2026, 10, 2, 12), 3)
    days = [cron.ms_to_wall(ms, ZoneInfo("Australia/Lord_Howe")).day for ms in fired]
    assert days == [3, 4, 5]
    assert cron.ms_to_wall(fired[1], ZoneInfo("Australia/Lord_Howe")).strftime("%H:%M") == "02:30"


def test_to_ms_and_wall_round_trip():
    now = utc(2026, 7, 1, 10, 30)
    assert cron.ms_to_wall(now, PARIS) == datetime(2026, 7, 1, 12, 30)
    assert to_ms(datetime(2026, 7, 1, 12, 30, tzinfo=PARIS)) == now
    assert timedelta(milliseconds=now - utc(2026, 7, 1)) == timedelta(hours=10, minutes=30)
