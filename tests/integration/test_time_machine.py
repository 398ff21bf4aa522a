"""Time travel in tests (``durable.testing.time_machine``): the real engine, a manual clock.

Runs under pytest-django's ``db`` (one wrapping transaction, where ``on_commit`` hooks
and NOTIFY never fire) and ``transactional_db``, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.test import TestCase

import durable
from durable.models import Timer, WorkflowRun
from durable.testing import time_machine
from testproject.demo.models import FireRecord

DAY = timedelta(days=1)
START = datetime(2031, 3, 1, 9, 0, tzinfo=UTC)


def note(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


@durable.workflow
def onboarding(ctx, user: str):
    """20 steps and 5 sleeps over 30 days."""
    done = []
    for week in range(5):
        for i in range(4):
            done.append(ctx.step(note, f"{user}:w{week}:s{i}"))
        ctx.sleep(6 * DAY)
    return len(done)


@durable.workflow
def late_sleeper(ctx):
    """Sleeps 3 days, then a step decides to sleep 1 day more: that sleep is scheduled
    at day 3, inside the trip."""
    ctx.sleep(3 * DAY)
    ctx.step(note, "day3")
    ctx.sleep(DAY)
    ctx.step(note, "day4")
    return "ok"


@durable.workflow
def greeter(ctx):
    name = ctx.wait_for_signal("name")
    ctx.atomic(note, f"hello:{name}")
    return name


@durable.handler
def chained(n: int) -> None:
    note(f"chained:{n}")
    if n < 3:
        durable.schedule(chained, args=(n + 1,), delay=DAY)


FAILS = {"count": 0}


@durable.handler(max_attempts=3)
def flaky() -> None:
    FAILS["count"] += 1
    raise RuntimeError("boom")


@durable.handler(atomic=False)
def outside(n: int) -> None:
    note(f"outside:{n}")


@durable.workflow
def child_nap(ctx, n):
    ctx.sleep(2 * DAY)
    return ctx.step(note, f"child:{n}")


@durable.workflow
def parent(ctx):
    results = [ctx.child(child_nap, n) for n in range(2)]
    ctx.sleep(DAY)
    return results


def keys(prefix: str = "") -> list[str]:
    rows = FireRecord.objects.filter(key__startswith=prefix)
    return sorted(rows.values_list("key", flat=True))


@pytest.mark.django_db
def test_a_30_day_workflow_of_20_steps_and_5_sleeps_runs_through_its_sleeps(durable_time_machine):
    # How long this takes is measured by bench/time_machine.py (docs/benchmarks.md), not
    # here: timed assertions fail on a loaded machine.
    machine = durable_time_machine
    run = onboarding.start("ann")
    trip = machine.advance(days=30)
    assert trip.completed == [run.pk]
    assert WorkflowRun.objects.get(pk=run.pk).result == 20
    assert len(keys("ann:")) == 20  # each step ran exactly once
    wakes = [fire for fire in trip if fire.target == run.pk]
    assert [f.at - trip.start for f in wakes] == [timedelta(0)] + [6 * DAY * k for k in range(1, 6)]
    assert all(f.state == "fired" for f in wakes) and trip.failed == []


@pytest.mark.django_db(transaction=True)
def test_the_same_outside_a_wrapping_transaction():
    with time_machine(START) as machine:
        run = onboarding.start("bob")
        trip = machine.advance(days=30)
        assert trip.completed == [run.pk] and len(keys("bob:")) == 20
        assert machine.now() == START + 30 * DAY


@pytest.mark.django_db
def test_a_sleep_scheduled_inside_the_window_fires_at_its_own_instant():
    with time_machine(START) as machine:
        run = late_sleeper.start()
        trip = machine.advance(days=30)
        assert trip.completed == [run.pk]
        assert [f.at - START for f in trip] == [timedelta(0), 3 * DAY, 4 * DAY]
        assert all(f.state == "fired" and f.kind == "workflow" for f in trip)
        assert trip.end == START + 30 * DAY == machine.now()


@pytest.mark.django_db
def test_handlers_that_schedule_handlers_fire_in_order_within_one_advance():
    with time_machine(START) as machine:
        durable.schedule(chained, args=(1,), delay=DAY)
        trip = machine.advance(days=10)
        assert [(f.at - START, f.target) for f in trip] == [
            (k * DAY, "tests.integration.test_time_machine.chained") for k in (1, 2, 3)
        ]
        assert keys("chained:") == ["chained:1", "chained:2", "chained:3"]
        assert machine.advance(days=10).fires == []


@pytest.mark.django_db
def test_retries_and_the_dead_letter_show_in_the_trip():
    FAILS["count"] = 0
    with time_machine(START) as machine:
        timer = durable.schedule(flaky)
        trip = machine.advance(hours=2)
        assert [f.state for f in trip] == ["retrying", "retrying", "failed"]
        assert [f.attempt for f in trip] == [1, 2, 3] and FAILS["count"] == 3
        assert "boom" in trip.fires[-1].error
        assert trip.fires[0].at < trip.fires[1].at < trip.fires[2].at
        assert Timer.objects.get(pk=timer.pk).state == "failed"


@pytest.mark.django_db
def test_a_signal_sent_in_the_test_wakes_the_waiting_run():
    with time_machine(START) as machine:
        run = greeter.start()
        machine.advance()
        assert WorkflowRun.objects.get(pk=run.pk).state == "waiting"
        durable.send_signal(run.pk, "name", "zoe")
        trip = machine.advance(seconds=1)
        assert trip.completed == [run.pk] and keys("hello:") == ["hello:zoe"]
        assert "completed" in str(trip)


@pytest.mark.django_db
def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="aware"), time_machine(datetime(2031, 1, 1)):
        pass
    with time_machine(START) as machine:
        with pytest.raises(ValueError, match="backwards"):
            machine.advance(timedelta(seconds=-1))
        with pytest.raises(ValueError, match="backwards"):
            machine.advance_to(START - DAY)
        assert machine.advance_to(START + DAY).end == START + DAY


@pytest.mark.django_db
def test_external_handlers_and_child_workflows_run_on_the_tests_connection():
    with time_machine(START) as machine:
        durable.schedule(outside, args=(7,), delay=timedelta(hours=5))
        run = parent.start()
        trip = machine.advance(days=10)
        assert keys("outside:") == ["outside:7"]
        assert WorkflowRun.objects.get(pk=run.pk).result == ["child:0", "child:1"]
        children = [r for r in trip.runs if r.name.endswith("child_nap")]
        assert len(children) == 2 and trip.completed[-1] == run.pk
        (fire,) = [f for f in trip if f.kind == "handler"]
        assert (fire.at - START, fire.state) == (timedelta(hours=5), "fired")
        # The children slept one after the other: 2 days each, then the parent's day.
        parent_wakes = [f.at - START for f in trip if f.target == run.pk]
        assert parent_wakes[-1] == 5 * DAY


@pytest.mark.django_db
def test_handlers_run_in_the_test_even_when_the_project_ships_them(settings):
    settings.DURABLE = {**getattr(settings, "DURABLE", {}), "DISPATCH": "kombu"}
    with time_machine(START) as machine:
        assert machine.engine.embedded is None
        durable.schedule(outside, args=(8,), delay=DAY)
        trip = machine.advance(days=2)
        assert [f.state for f in trip] == ["fired"] and keys("outside:") == ["outside:8"]


class TimeMachineInADjangoTestCase(TestCase):
    """Django's ``TestCase`` wraps each test in a transaction too."""

    def test_a_run_sleeps_and_completes(self):
        with time_machine(START) as machine:
            run = late_sleeper.start()
            trip = machine.advance(days=5)
        self.assertEqual(trip.completed, [run.pk])
        self.assertEqual(keys("day"), ["day3", "day4"])
