"""Cron and interval schedules through the real worker engine, turn by turn, manual clock.

Like tests/integration/test_worker_engine.py: an in-process ``Engine`` on the test
database (SQLite or PostgreSQL), a ``ManualClock`` installed with ``override_clock``, and
``engine.tick()`` for each turn. A tick that follows a clock move of at least the rescan
interval (1 s here) re-reads what is due, which is how the next occurrence, inserted by
the previous fire, reaches the wheel without NOTIFY.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

import durable
from durable.core.cron import ms_to_wall, to_ms
from durable.core.sharding import shard_for
from durable.exceptions import ScheduleError
from durable.models import CronSchedule, Timer
from durable.scheduling import schedules
from durable.scheduling.cron import sync_declared
from durable.scheduling.specs import build_spec
from durable.storage.schedules import occurrence_timer
from durable.testing import ManualClock, override_clock
from testproject.demo.models import FireRecord
from tests.integration.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

S = 1_000
MIN = 60 * S
START = to_ms(datetime(2030, 1, 7, 9, 0, 30, tzinfo=UTC))  # half a minute past a minute
RECORD = "testproject.demo.crons.record"


@pytest.fixture
def clock():
    manual = ManualClock(start_ms=START)
    with override_clock(manual):
        yield manual


@pytest.fixture
def engine(start_engine):
    settings = {"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}
    return start_engine(settings, node="cron-node")


def step(engine, clock, ms=S, times=1):
    for _ in range(times):
        clock.advance(ms)
        engine.tick()


def runs(name):
    """``(occurrence ms, catch_up)`` of every run recorded for schedule ``name``, in order."""
    rows = FireRecord.objects.filter(key__startswith=f"{name}:").order_by("due_at_ms", "id")
    return [(r.due_at_ms, r.key.endswith(":catch_up")) for r in rows]


def row(name):
    return CronSchedule.objects.get(name=name)


def pending(name):
    return list(
        Timer.objects.filter(target=name, kind="cron", state="pending").values_list(
            "fire_at_ms", flat=True
        )
    )


# -- firing ----------------------------------------------------------------------------


def test_each_occurrence_fires_once_on_time_and_chains_the_next(engine, clock):
    schedules.create("tick", RECORD, every=timedelta(seconds=1))
    first = START + S
    timer = Timer.objects.get(target="tick")
    assert (timer.kind, timer.key, timer.fire_at_ms) == ("cron", f"cron:tick:{first}", first)
    assert timer.shard == shard_for("cron:tick", 4)
    step(engine, clock, times=10)
    assert runs("tick") == [(first + i * S, False) for i in range(10)]
    for rec in FireRecord.objects.all():
        assert rec.fired_at_ms == rec.due_at_ms  # ticks land on the occurrences: no lateness
    schedule = row("tick")
    assert (schedule.fired_count, schedule.failed_count, schedule.skipped_count) == (10, 0, 0)
    assert schedule.last_status == "succeeded" and schedule.last_error == ""
    assert schedule.last_scheduled_ms == first + 9 * S
    assert schedule.next_ms == first + 10 * S == to_ms(schedule.next_at)
    assert pending("tick") == [first + 10 * S]
    assert Timer.objects.filter(target="tick", state="fired").count() == 10


SEEN = []


@durable.handler  # registered: what a schedule created at run time may name
def remember(occurrence):
    SEEN.append(occurrence)


def test_the_handler_receives_the_occurrence(engine, clock):
    SEEN.clear()
    schedules.create(
        "paris", "tests.integration.test_cron.remember", cron="* * * * *", tz="Europe/Paris"
    )
    step(engine, clock, ms=30 * S)
    (occurrence,) = SEEN
    assert occurrence.schedule == "paris" and occurrence.catch_up is False
    assert occurrence.scheduled_at == datetime(2030, 1, 7, 10, 1, tzinfo=ZoneInfo("Europe/Paris"))
    assert occurrence.scheduled_at.utcoffset() == timedelta(hours=1)
    assert occurrence.scheduled_ms == START + 30 * S
    assert occurrence.idempotency_key == f"cron:paris:{START + 30 * S}"
    assert occurrence.missed == 0


@pytest.mark.parametrize(
    ("tz", "start", "expected"),
    [
        (
            "Europe/Paris",
            datetime(2030, 3, 29, 12, tzinfo=UTC),  # spring forward on Sunday 31 March
            ["03-30 02:30 CET", "03-31 03:00 CEST", "04-01 02:30 CEST"],
        ),
        (
            "Europe/Paris",
            datetime(2030, 10, 25, 12, tzinfo=UTC),  # fall back on Sunday 27 October
            ["10-26 02:30 CEST", "10-27 02:30 CEST", "10-28 02:30 CET"],
        ),
        (
            "America/New_York",
            datetime(2030, 3, 8, 12, tzinfo=UTC),  # spring forward on Sunday 10 March
            ["03-09 02:30 EST", "03-10 03:00 EDT", "03-11 02:30 EDT"],
        ),
        (
            "America/New_York",
            datetime(2030, 11, 1, 12, tzinfo=UTC),  # fall back on Sunday 3 November
            ["11-02 02:30 EDT", "11-03 02:30 EST", "11-04 02:30 EST"],
        ),
    ],
)
def test_a_0230_schedule_fires_once_on_each_dst_day(engine, clock, tz, start, expected):
    clock.set(start)
    engine.tick()
    schedules.create("night", RECORD, cron="30 2 * * *", tz=tz)
    for _ in range(3):
        clock.set(row("night").next_ms)  # the worker wakes exactly at each occurrence
        engine.tick()
        clock.advance(6 * 60 * MIN)  # and lives through the rest of the night
        engine.tick()
    zone = ZoneInfo(tz)
    fired = [
        ms_to_wall(ms, zone).strftime("%m-%d %H:%M ")
        + datetime.fromtimestamp(ms / 1000, UTC).astimezone(zone).tzname()
        for ms, _ in runs("night")
    ]
    assert fired == expected
    assert row("night").skipped_count == 0


@pytest.mark.parametrize(
    ("expression", "start", "expected"),
    [
        # Wildcards (minute or hour field starting with "*") follow the running clock,
        # as Vixie cron's do: nothing in the skipped hour, both passes of the repeated one.
        (
            "*/30 * * * *",
            datetime(2030, 3, 31, 0, 15, tzinfo=UTC),  # Paris springs forward at 01:00 UTC
            ["03-31 01:30 CET", "03-31 03:00 CEST", "03-31 03:30 CEST"],
        ),
        (
            "*/30 * * * *",
            datetime(2030, 10, 27, 0, 15, tzinfo=UTC),  # and falls back at 01:00 UTC
            ["10-27 02:30 CEST", "10-27 02:00 CET", "10-27 02:30 CET"],
        ),
        (
            "0 */2 * * *",
            datetime(2030, 3, 30, 22, 30, tzinfo=UTC),
            ["03-31 00:00 CET", "03-31 04:00 CEST", "03-31 06:00 CEST"],
        ),
        (
            "0 */2 * * *",
            datetime(2030, 10, 26, 22, 30, tzinfo=UTC),
            ["10-27 02:00 CEST", "10-27 02:00 CET", "10-27 04:00 CET"],
        ),
    ],
)
def test_wildcard_schedules_follow_the_clock_across_dst(engine, clock, expression, start, expected):
    clock.set(start)
    engine.tick()
    schedules.create("wild", RECORD, cron=expression, tz="Europe/Paris")
    for _ in expected:
        clock.set(row("wild").next_ms)
        engine.tick()
        clock.advance(S)
        engine.tick()
    zone = ZoneInfo("Europe/Paris")
    fired = [
        ms_to_wall(ms, zone).strftime("%m-%d %H:%M ")
        + datetime.fromtimestamp(ms / 1000, UTC).astimezone(zone).tzname()
        for ms, _ in runs("wild")
    ]
    assert fired == expected
    assert row("wild").skipped_count == 0


def test_an_interval_keeps_its_utc_cadence_across_dst(engine, clock):
    clock.set(datetime(2030, 3, 31, 0, 30, tzinfo=UTC))  # Paris springs forward at 01:00 UTC
    engine.tick()
    schedules.create("ten-minutes", RECORD, every=timedelta(minutes=10))
    step(engine, clock, ms=10 * MIN, times=12)
    fired = [ms for ms, _ in runs("ten-minutes")]
    assert len(fired) == 12 and {b - a for a, b in itertools.pairwise(fired)} == {10 * MIN}


# -- missed occurrences ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected_catch_up", "skipped"),
    [("skip", [], 3), ("fire_once", [3], 2), ("fire_all", [1, 2, 3], 0)],
)
def test_downtime_across_three_occurrences(engine, clock, policy, expected_catch_up, skipped):
    minute = START + 30 * S
    schedules.create(
        f"down-{policy}",
        RECORD,
        every=timedelta(minutes=1),
        catch_up=policy,
        grace=timedelta(seconds=10),
    )
    step(engine, clock, ms=30 * S)  # the first occurrence runs
    # Nobody fires for three and a half minutes: three occurrences pass.
    clock.advance(3 * MIN + 30 * S)
    engine.tick()
    step(engine, clock, times=5)  # chained catch-up timers come due at once
    clock.set(minute + 4 * MIN)  # the next one, on time again
    engine.tick()
    got = runs(f"down-{policy}")
    assert got[0] == (minute, False) and got[-1] == (minute + 4 * MIN, False)
    assert got[1:-1] == [(minute + k * MIN, True) for k in expected_catch_up]
    assert row(f"down-{policy}").skipped_count == skipped


def test_a_late_occurrence_within_grace_is_not_missed(engine, clock):
    schedules.create("grace", RECORD, every=timedelta(minutes=1), catch_up="skip")
    clock.advance(30 * S + 45 * S)  # 45 s late: within the default minute of grace
    engine.tick()
    assert runs("grace") == [(START + 30 * S, False)]
    assert row("grace").skipped_count == 0


def test_fire_all_is_capped_at_a_thousand(engine, clock):
    schedules.create(
        "flood", RECORD, every=timedelta(seconds=1), catch_up="fire_all", grace=timedelta(0)
    )
    clock.advance(1_200 * S + 500)  # 1,200 occurrences missed
    engine.tick()
    schedule = row("flood")
    assert schedule.skipped_count == 200
    assert runs("flood") == [(START + 201 * S, True)]  # the oldest of the thousand kept
    timer = Timer.objects.get(target="flood", state="pending")
    assert timer.kwargs == {
        "scheduled_ms": START + 202 * S,
        "catch_up": True,
        "until_ms": START + 1_200 * S,
    }
    step(engine, clock, times=3)
    assert [ms for ms, _ in runs("flood")] == [START + k * S for k in range(201, 205)]


# -- overlap -------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", ["skip", "queue"])
def test_runs_of_a_slow_handler_never_overlap(engine, clock, overlap):
    name = f"slow-{overlap}-2500"  # the handler takes 2.5 s of the manual clock
    schedules.create(
        name, "testproject.demo.crons.slow", every=timedelta(seconds=1), overlap=overlap
    )
    step(engine, clock, times=12)
    records = list(FireRecord.objects.filter(key__startswith=name).order_by("id"))
    started = [r.fired_at_ms for r in records]
    occurrences = [r.due_at_ms for r in records]
    assert len(records) >= 4
    assert all(b >= a + 2_500 for a, b in itertools.pairwise(started)), started
    assert occurrences == sorted(set(occurrences))
    assert all(r.fired_at_ms >= r.due_at_ms for r in records)  # never early
    schedule = row(name)
    assert schedule.skipped_count > 0 and schedule.last_duration_ms == 2_500
    # An occurrence that came due while the previous run was running: skip drops every
    # one of them, queue runs (the latest of) them afterwards.
    waited = [
        occurrence
        for previous, occurrence in zip(started, occurrences[1:], strict=False)
        if previous < occurrence <= previous + 2_500
    ]
    assert bool(waited) == (overlap == "queue"), (started, occurrences)


# -- many occurrences due together ------------------------------------------------------


def test_simultaneous_occurrences_share_one_locked_read_one_insert_and_one_update(engine, clock):
    names = [f"pulse-{i}" for i in range(10)]
    for name in names:
        schedules.create(name, RECORD, every=timedelta(seconds=1))
    step(engine, clock)  # the first occurrences (this process learns each schedule's mode)
    clock.advance(S)
    with CaptureQueriesContext(connection) as queries:
        engine.tick()
    sql = [q["sql"] for q in queries.captured_queries]
    cron = [s for s in sql if "durable_cronschedule" in s]
    reads = [s for s in cron if s.startswith("SELECT")]
    assert len(reads) == 1
    if connection.features.has_select_for_update:
        assert "FOR UPDATE" in reads[0]
    updates = [s for s in cron if s.startswith("UPDATE")]
    assert len(updates) == (1 if connection.vendor == "postgresql" else len(names))
    inserts = [s for s in sql if s.startswith("INSERT") and '"durable_timer"' in s.split("(")[0]]
    assert len(inserts) == 1, inserts
    for name in names:
        assert runs(name) == [(START + S, False), (START + 2 * S, False)]
        assert pending(name) == [START + 3 * S]
        schedule = row(name)
        assert (schedule.fired_count, schedule.next_ms) == (2, START + 3 * S)
        assert to_ms(schedule.next_at) == START + 3 * S


def test_one_failing_handler_among_simultaneous_occurrences_fails_only_its_run(engine, clock):
    schedules.create("ok-1", RECORD, every=timedelta(seconds=1))
    schedules.create("bad", "testproject.demo.crons.fail", every=timedelta(seconds=1))
    schedules.create("ok-2", RECORD, every=timedelta(seconds=1))
    step(engine, clock, times=2)
    assert (row("bad").failed_count, row("bad").last_status) == (2, "failed")
    for name in ("ok-1", "ok-2"):
        assert (row(name).fired_count, row(name).last_status) == (2, "succeeded")
        # The batch was rolled back and redone one occurrence at a time: effects once.
        assert runs(name) == [(START + S, False), (START + 2 * S, False)]
    assert FireRecord.objects.filter(key__startswith="bad").count() == 0
    for name in ("ok-1", "bad", "ok-2"):
        assert pending(name) == [START + 3 * S]


def test_a_next_occurrence_whose_key_was_used_is_skipped_past(engine, clock):
    schedules.create("taken", RECORD, every=timedelta(seconds=1))
    used = occurrence_timer("taken", START + 2 * S)
    used.state = "fired"
    used.save()
    step(engine, clock)
    assert runs("taken") == [(START + S, False)]
    assert row("taken").next_ms == START + 3 * S and pending("taken") == [START + 3 * S]
    step(engine, clock, times=2)
    assert runs("taken") == [(START + S, False), (START + 3 * S, False)]


# -- failures and stale timers ----------------------------------------------------------


def test_a_failing_handler_is_recorded_and_the_chain_goes_on(engine, clock):
    schedules.create("boom", "testproject.demo.crons.fail", every=timedelta(seconds=1))
    step(engine, clock, times=2)
    schedule = row("boom")
    assert (schedule.fired_count, schedule.failed_count) == (0, 2)
    assert schedule.last_status == "failed"
    assert "planned failure" in schedule.last_error and "/srv/app" not in schedule.last_error
    assert FireRecord.objects.filter(key__startswith="boom").count() == 0  # rolled back
    assert Timer.objects.filter(target="boom", state="fired").count() == 2  # no retries
    assert pending("boom") == [START + 3 * S]


def test_an_unimportable_handler_fails_the_run_not_the_worker(engine, clock):
    schedules.create("gone", RECORD, every=timedelta(seconds=1))
    CronSchedule.objects.filter(name="gone").update(handler="testproject.demo.crons.nope")
    step(engine, clock)
    assert row("gone").last_status == "failed" and "nope" in row("gone").last_error
    assert pending("gone") == [START + 2 * S]


def test_a_stale_occurrence_timer_fires_as_a_no_op(engine, clock):
    schedules.create("stale", RECORD, every=timedelta(seconds=1))
    # A timer the chain does not point at (one a change raced with, say).
    Timer.objects.filter(target="stale").update(key="cron:stale:other")
    CronSchedule.objects.filter(name="stale").update(next_ms=START + 5 * S)
    step(engine, clock)
    assert runs("stale") == []
    assert Timer.objects.get(key="cron:stale:other").state == "fired"
    assert row("stale").next_ms == START + 5 * S


# -- atomic=False ------------------------------------------------------------------------


def test_an_external_schedule_runs_outside_the_transaction_then_chains(engine, clock):
    schedules.create("ext", RECORD, every=timedelta(seconds=1), atomic=False)
    step(engine, clock)
    assert wait_for(lambda: row("ext").fired_count == 1)
    schedule = row("ext")
    assert schedule.running is None and schedule.last_status == "succeeded"
    assert wait_for(lambda: pending("ext") == [START + 2 * S])
    assert runs("ext") == [(START + S, False)]
    assert wait_for(lambda: engine.firer.in_flight == 0)
    step(engine, clock)
    assert wait_for(lambda: row("ext").fired_count == 2)


def test_an_external_run_whose_worker_died_runs_again_and_is_recorded(engine, clock):
    schedules.create("crashy", RECORD, every=timedelta(seconds=1), atomic=False)
    occurrence = START + S
    timer = Timer.objects.get(target="crashy")
    # A worker decided, set the running marker, claimed the timer and died.
    CronSchedule.objects.filter(name="crashy").update(
        running={
            "timer_ms": occurrence,
            "runs": [[occurrence, False, 0]],
            "next_ms": occurrence + S,
            "next": {},
            "handler": RECORD,
            "tz": "UTC",
        },
        running_until_ms=occurrence,
        next_ms=occurrence + S,
    )
    Timer.objects.filter(pk=timer.pk).update(
        state="firing", attempts=1, claim_expires_ms=occurrence
    )
    clock.advance(S)
    engine.runners[timer.shard].rescan(clock.now_ms())
    engine.tick()
    assert wait_for(lambda: row("crashy").running is None and row("crashy").fired_count == 1)
    schedule = row("crashy")
    assert schedule.failed_count == 1  # the interrupted attempt
    assert runs("crashy") == [(occurrence, False)]
    assert wait_for(lambda: pending("crashy") == [occurrence + S])


# -- run-time changes -------------------------------------------------------------------------


def test_update_replaces_the_pending_occurrence_in_the_same_transaction(engine, clock):
    schedules.create("change", RECORD, every=timedelta(minutes=1))
    assert pending("change") == [START + 30 * S]
    with transaction.atomic():
        schedules.update("change", cron="*/5 * * * *")
        assert pending("change") == [to_ms(datetime(2030, 1, 7, 9, 5, tzinfo=UTC))]
    with pytest.raises(RuntimeError), transaction.atomic():
        schedules.update("change", every=timedelta(seconds=10))
        raise RuntimeError("roll back")
    assert pending("change") == [to_ms(datetime(2030, 1, 7, 9, 5, tzinfo=UTC))]
    schedule = row("change")
    assert (schedule.kind, schedule.expression, schedule.interval_ms) == (
        "cron",
        "*/5 * * * *",
        None,
    )
    clock.set(datetime(2030, 1, 7, 9, 5, tzinfo=UTC))
    engine.tick()
    assert [ms for ms, _ in runs("change")] == [clock.now_ms()]


def test_pause_and_resume_follow_the_catch_up_policy(engine, clock):
    schedules.create(
        "nap", RECORD, every=timedelta(seconds=10), catch_up="fire_once", grace=timedelta(0)
    )
    step(engine, clock, ms=10 * S, times=2)  # 09:00:40 and 09:00:50 run
    schedules.pause("nap")
    assert pending("nap") == [] and row("nap").enabled is False
    step(engine, clock, ms=10 * S, times=5)
    assert len(runs("nap")) == 2
    clock.advance(5 * S)  # 09:01:45: 09:01:00 to 09:01:40 passed while paused
    schedules.resume("nap")
    assert pending("nap") == [START + 30 * S]  # the occurrence that was next at the pause
    engine.runners[shard_for("cron:nap", 4)].rescan(clock.now_ms())
    engine.tick()
    assert runs("nap")[2:] == [(START + 70 * S, True)]  # the latest missed, once
    assert row("nap").skipped_count == 4
    assert pending("nap") == [START + 80 * S]


def test_delete_removes_the_schedule_and_its_pending_occurrence(engine, clock):
    schedules.create("bye", RECORD, every=timedelta(seconds=1))
    assert schedules.delete("bye") is True
    assert not CronSchedule.objects.filter(name="bye").exists() and pending("bye") == []
    step(engine, clock, times=3)
    assert runs("bye") == []
    assert schedules.delete("bye") is False


def test_runtime_api_errors(clock):
    schedules.create("dup", RECORD, every=timedelta(seconds=1))
    with pytest.raises(ScheduleError, match="'dup' exists"):
        schedules.create("dup", RECORD, every=timedelta(seconds=1))
    with pytest.raises(ScheduleError, match="no schedule named 'nope'"):
        schedules.pause("nope")
    with pytest.raises(ScheduleError, match="tz: unknown time zone"):
        schedules.update("dup", cron="0 9 * * *", tz="Nowhere/Else")
    with pytest.raises(ScheduleError, match="exactly one of cron= and every="):
        schedules.create("both", RECORD, cron="* * * * *", every=timedelta(seconds=1))
    assert schedules.get("dup").name == "dup"
    assert not CronSchedule.objects.filter(name="both").exists()


# -- declared schedules -----------------------------------------------------------------------


def spec(name, **options):
    options.setdefault("every", timedelta(minutes=1))
    return build_spec(name=name, handler=RECORD, source="code", **options)


def test_sync_declared_creates_updates_pauses_and_repairs(clock):
    report = sync_declared(now_ms=START, specs=[spec("a"), spec("b")])
    assert report.created == ["a", "b"] and pending("a") == [START + 30 * S]
    assert sync_declared(now_ms=START, specs=[spec("a"), spec("b")]).unchanged == 2
    # A paused declared schedule stays paused while its declaration does not change.
    schedules.pause("b")
    report = sync_declared(now_ms=START, specs=[spec("a", every=timedelta(seconds=10)), spec("b")])
    assert report.updated == ["a"] and pending("a") == [START + 10 * S]
    assert row("b").enabled is False
    # Dropped from the code: paused; declared again: back on.
    report = sync_declared(now_ms=START, specs=[spec("b")])
    assert report.undeclared == ["a"] and row("a").enabled is False and pending("a") == []
    report = sync_declared(now_ms=START, specs=[spec("a", every=timedelta(seconds=10)), spec("b")])
    assert report.updated == ["a"] and row("a").enabled and pending("a") == [START + 10 * S]
    # A lost occurrence timer is put back.
    Timer.objects.filter(target="a").delete()
    assert sync_declared(now_ms=START, specs=[spec("a", every=timedelta(seconds=10))]).repaired == [
        "a"
    ]
    assert pending("a") == [START + 10 * S]


def test_settings_crons_are_synced_and_checked(clock, settings):
    settings.DURABLE = {
        "CRONS": {
            "nightly": {
                "task": RECORD,
                "cron": "0 3 * * *",
                "tz": "Europe/Paris",
                "catch_up": "skip",
            },
            "often": {"task": RECORD, "every": 90},
        }
    }
    report = sync_declared(now_ms=START)
    assert set(report.created) >= {"nightly", "often"}
    nightly = row("nightly")
    assert (nightly.source, nightly.timezone, nightly.catch_up) == (
        "settings",
        "Europe/Paris",
        "skip",
    )
    assert nightly.next_ms == to_ms(datetime(2030, 1, 8, 3, tzinfo=ZoneInfo("Europe/Paris")))
    assert row("often").interval_ms == 90_000


def test_decorators_declare_and_validate_at_import(clock):
    from durable.scheduling.cron import declared

    try:
        durable.cron.daily(at="07:15", tz="Europe/Paris", name="decl-daily")(decorated_job)
        durable.every(timedelta(minutes=5), name="decl-every", overlap="queue")(decorated_job)
        names = {s.name: s for s in declared.specs()}
        assert names["decl-daily"].expression == "15 7 * * *"
        assert names["decl-daily"].handler == "tests.integration.test_cron.decorated_job"
        assert names["decl-every"].interval_ms == 300_000
        with pytest.raises(ScheduleError, match="already declared"):
            durable.cron("* * * * *", name="decl-daily")(other_job)
        report = sync_declared(now_ms=START, specs=[names["decl-daily"], names["decl-every"]])
        assert report.created == ["decl-daily", "decl-every"]
    finally:
        declared.unregister("decl-daily")
        declared.unregister("decl-every")
    assert decorated_job(None) == "called directly"  # the function is returned unchanged


def decorated_job(occurrence):
    return "called directly"


def other_job(occurrence):
    return None


def test_management_command_syncs(clock, settings, capsys):
    from django.core.management import call_command

    settings.DURABLE = {"CRONS": {"cmd": {"task": RECORD, "cron": "@hourly"}}}
    call_command("durable_sync_schedules")
    assert "created 1 (cmd)" in capsys.readouterr().out
    call_command("durable_sync_schedules")
    assert "unchanged" in capsys.readouterr().out
    assert row("cmd").expression == "0 * * * *"


# -- validation -----------------------------------------------------------------------------


JOB = "tests.integration.test_cron.decorated_job"


@pytest.mark.parametrize(
    ("decorate", "message"),
    [
        (lambda: durable.cron("61 * * * *"), "cron: invalid cron expression '61 \\* \\* \\* \\*'"),
        (lambda: durable.cron("0 9 * * *", tz="Europe/Pariss"), "tz: unknown time zone"),
        (lambda: durable.cron("0 9 * * *", catch_up="latest"), "catch_up: expected one of"),
        (lambda: durable.cron("0 9 * * *", overlap="allow"), "overlap: expected one of"),
        (lambda: durable.every(timedelta(milliseconds=500)), "every: expected a timedelta or a"),
        (lambda: durable.cron("0 9 * * *", grace=timedelta(seconds=-1)), "grace"),
        (lambda: durable.cron.daily(at="25:00"), "at: expected 'HH:MM'"),
        (lambda: durable.cron.weekly(on="someday"), "on: expected day names"),
    ],
)
def test_bad_declarations_raise_at_import_naming_the_function_and_argument(decorate, message):
    with pytest.raises(ScheduleError, match=f"^@durable.(cron|every) on {JOB}: {message}"):
        decorate()(decorated_job)


@pytest.mark.parametrize(
    ("period", "shown"),
    [
        (0, "got 0"),
        (-5, "got -5"),
        (0.5, "got 0.5"),
        (float("nan"), "got nan"),
        (float("inf"), "got inf"),
        (True, "got True"),
        ("60", "got '60'"),
        (366 * 86_400 + 1, "got 31622401"),
        (timedelta(days=367), "got datetime.timedelta\\(days=367\\)"),
    ],
)
def test_every_refuses_bad_periods_naming_the_argument(period, shown):
    expected = f"@durable.every on {JOB}: every: expected a timedelta or a number of seconds "
    with pytest.raises(ScheduleError, match=f"^{expected}from 1 s to 366 days, {shown}$"):
        durable.every(period)(decorated_job)
    with pytest.raises(ScheduleError, match=r"every: .*not whole milliseconds"):
        durable.every(1.0001)(decorated_job)


def test_every_takes_seconds_as_crons_does(clock):
    from durable.scheduling.cron import declared

    try:
        durable.every(5, name="five")(decorated_job)
        durable.every(1.5, name="one-and-a-half", grace=2)(decorated_job)
        durable.every(366 * 86_400, name="yearly-ish")(decorated_job)
        specs = {s.name: s for s in declared.specs()}
        assert specs["five"].interval_ms == 5_000
        assert (specs["one-and-a-half"].interval_ms, specs["one-and-a-half"].grace_ms) == (
            1_500,
            2_000,
        )
        assert specs["yearly-ish"].interval_ms == 366 * 86_400_000
    finally:
        for name in ("five", "one-and-a-half", "yearly-ish"):
            declared.unregister(name)


def test_a_bad_declaration_reports_every_problem_at_once():
    from durable.checks import _schedule_errors

    with pytest.raises(ScheduleError) as caught:
        durable.cron(
            "61 * * * *",
            tz="Mars/Olympus",
            catch_up="latest",
            overlap="allow",
            grace=-1,
            atomic="yes",
            kwargs=["not", "a", "dict"],
            name=" padded ",
        )(decorated_job)
    where = f"@durable.cron on {JOB}"
    assert str(caught.value).startswith(f"{where}: name: ' padded ' has control characters")
    messages = [(e.id, e.msg) for e in _schedule_errors(caught.value)]
    assert [i for i, _ in messages] == [
        "durable.E019",
        "durable.E010",
        "durable.E011",
        "durable.E012",
        "durable.E013",
        "durable.E018",
        "durable.E018",
        "durable.E018",
    ]
    assert all(m.startswith(f"{where}: ") for _, m in messages)
    fields = [m.removeprefix(f"{where}: ").split(":", 1)[0] for _, m in messages]
    assert fields == ["name", "cron", "tz", "catch_up", "overlap", "grace", "atomic", "kwargs"]
    # A helper's own argument is one problem among the others.
    with pytest.raises(ScheduleError) as caught:
        durable.cron.daily(at="25:00", tz="Mars/Olympus")(decorated_job)
    assert [p.field for p in caught.value.problems] == ["at", "tz"]


def test_a_name_declared_twice_names_both_functions():
    from durable.scheduling.cron import declared

    durable.cron("0 9 * * *", name="dup")(decorated_job)
    try:
        with pytest.raises(ScheduleError) as caught:
            durable.cron("0 9 * * *", name="dup")(other_job)
        assert str(caught.value) == (
            "tests.integration.test_cron.other_job: name: schedule 'dup' is already declared "
            f"for {JOB}; pass a distinct name="
        )
        assert caught.value.check_id == "durable.E014"
    finally:
        declared.unregister("dup")


def test_a_function_that_cannot_take_an_occurrence_is_refused():
    with pytest.raises(ScheduleError, match="not importable by name"):
        durable.cron("0 9 * * *")(lambda occurrence: None)
    with pytest.raises(ScheduleError, match="one positional argument"):
        schedules.create("noargs", "tests.integration.test_cron.takes_nothing", every=timedelta(1))
    with pytest.raises(ScheduleError, match="cannot import"):
        schedules.create("missing", "tests.integration.test_cron.nope", every=timedelta(1))


def takes_nothing():
    return None


def test_check_reports_each_kind_of_bad_crons_entry(settings):
    from durable.checks import check_crons

    settings.DURABLE = {
        "CRONS": {
            "expr": {"task": RECORD, "cron": "0 0 30 2 *"},
            "zone": {"task": RECORD, "cron": "0 9 * * *", "tz": "Mars/Olympus"},
            "catch": {"task": RECORD, "cron": "0 9 * * *", "catch_up": "sometimes"},
            "overlap": {"task": RECORD, "every": 60, "overlap": "parallel"},
            "shape": {"task": RECORD, "cron": "0 9 * * *", "every": 60},
            "keys": {"task": RECORD, "cron": "0 9 * * *", "timezone": "UTC"},
            "task": {"task": "myapp.nowhere.job", "cron": "0 9 * * *"},
            "every": {"task": RECORD, "every": 0.5},
            "grace": {"task": RECORD, "every": 60, "grace": -5},
            " name ": {"task": RECORD, "every": 60},
            "fine": {"task": RECORD, "cron": "@daily", "tz": "Asia/Tokyo"},
        }
    }
    found = {}
    for error in check_crons():
        found.setdefault(error.id, []).append(error.msg)
    assert sorted(found) == [f"durable.E0{n}" for n in (10, 11, 12, 13, 15, 16, 17, 18, 19)]
    assert len(found["durable.E015"]) == 2  # both cron and every; an unknown key
    assert found["durable.E010"] == [
        "DURABLE['CRONS']['expr']: cron: invalid cron expression '0 0 30 2 *': "
        "it never matches a date"
    ]
    assert found["durable.E011"][0].startswith("DURABLE['CRONS']['zone']: tz: unknown time zone")
    assert found["durable.E017"] == [
        "DURABLE['CRONS']['every']: every: expected a timedelta or a number of seconds "
        "from 1 s to 366 days, got 0.5"
    ]
    assert found["durable.E016"][0].startswith(
        "DURABLE['CRONS']['task']: handler: cannot import 'myapp.nowhere.job'"
    )


def test_check_reports_every_problem_of_one_crons_entry(settings):
    from durable.checks import check_crons

    settings.DURABLE = {
        "CRONS": {
            "messy": {
                "task": "myapp.nowhere.job",
                "cron": "61 * * * *",
                "tz": "Mars/Olympus",
                "catch_up": "sometimes",
                "timezone": "UTC",
                "kwargs": {"when": {1, 2}},
            },
            "no-task": {"every": 0},
        }
    }
    errors = [(e.id, e.msg) for e in check_crons()]
    assert [i for i, _ in errors] == [
        "durable.E015",
        "durable.E010",
        "durable.E011",
        "durable.E012",
        "durable.E018",
        "durable.E016",
        "durable.E015",
        "durable.E017",
    ]
    assert all(m.startswith("DURABLE['CRONS']['messy']: ") for _, m in errors[:6])
    assert all(m.startswith("DURABLE['CRONS']['no-task']: ") for _, m in errors[6:])
    assert errors[0][1].endswith(
        "unknown key(s) 'timezone'; allowed: "
        + ", ".join(
            sorted(
                [
                    "anchor",
                    "atomic",
                    "catch_up",
                    "cron",
                    "every",
                    "grace",
                    "kwargs",
                    "overlap",
                    "task",
                    "tz",
                ]
            )
        )
    )
    assert "kwargs['when']" in errors[4][1]
    assert errors[6][1] == "DURABLE['CRONS']['no-task']: task: missing (the function's dotted path)"


def test_check_names_the_decorated_function_in_every_message(settings):
    from durable.checks import check_crons

    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, "tests.integration.bad_crons_app"]
    where = "@durable.cron on tests.integration.bad_crons_app.crons.nightly"
    errors = [(e.id, e.msg) for e in check_crons()]
    assert [i for i, _ in errors] == ["durable.E010", "durable.E011", "durable.E018"]
    assert all(m.startswith(f"{where}: ") for _, m in errors)
    assert errors[0][1] == (
        f"{where}: cron: invalid cron expression '0 25 * * *': is not acceptable, out of range"
    )
    assert errors[1][1].startswith(f"{where}: tz: unknown time zone 'Mars/Olympus'")
    assert errors[2][1].startswith(f"{where}: kwargs: ") and "'colour'" in errors[2][1]


def test_check_reports_a_name_declared_twice(settings):
    from durable.checks import check_crons
    from durable.scheduling.cron import declared

    durable.every(timedelta(minutes=1), name="twice")(decorated_job)
    try:
        settings.DURABLE = {"CRONS": {"twice": {"task": RECORD, "every": 60}}}
        assert [e.id for e in check_crons()] == ["durable.E014"]
        with pytest.raises(ScheduleError, match="also declared"):
            sync_declared(now_ms=START)
    finally:
        declared.unregister("twice")
    settings.DURABLE = {"CRONS": {"once": {"task": RECORD, "every": 60}}}
    assert check_crons() == []
