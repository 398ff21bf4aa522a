"""durable's own timestamps come from its injected clock (``durable.core.clock``), never
from the wall clock: under time travel a signal sent at +20 h reads as sent at +20 h.

The machine starts in 2031 while the wall clock is years earlier, so any wall-clock
stamp (Django's ``auto_now``, ``timezone.now()``) falls outside the trip. On SQLite and
PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.apps import apps
from django.db import models, transaction

import durable
from durable.core.timeutil import datetime_to_ms
from durable.models import WorkflowRun, WorkflowSignal, WorkflowStep
from durable.testing import ManualClock, override_clock, time_machine
from testproject.demo.models import FireRecord

START = datetime(2031, 3, 1, 9, 0, tzinfo=UTC)
HOURS_20 = timedelta(hours=20)
TRIP_END = START + timedelta(days=2)

MODELS = sorted(apps.get_app_config("durable").get_models(), key=lambda m: m.__name__)

# The tests read the trip's snapshot; the mark makes pytest-django set the database up.
pytestmark = pytest.mark.django_db


def note(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


@durable.handler
def stamped(label: str) -> None:
    note(label)


@durable.handler(atomic=False, concurrency_key="stamps", max_concurrency=1)
def limited(label: str) -> None:
    note(label)


@durable.workflow
def late_signal(ctx):
    """A step at once, a signal awaited (sent at +20 h), then a step after a sleep."""
    ctx.step(note, "first")
    name = ctx.wait_for_signal("go")
    ctx.sleep(timedelta(hours=1))
    ctx.step(note, f"after:{name}")
    return name


def _times(model: type[models.Model]) -> list[str]:
    return [f.attname for f in model._meta.concrete_fields if isinstance(f, models.DateTimeField)]


@pytest.fixture(scope="module")
def trip(django_db_setup, django_db_blocker):
    """One trip (the engine's start costs a second or two) that writes a row of every
    durable model with times well after START: its rows' times by model, plus the run's
    and the signal's ids. Rolled back once read."""
    with django_db_blocker.unblock(), transaction.atomic():
        with time_machine(START) as machine:
            durable.schedules.create(
                "stamps", "testproject.demo.crons.record", every=timedelta(hours=6)
            )
            durable.schedule(stamped, args=["late"], delay=timedelta(hours=3))
            durable.schedule(limited, args=["keyed"], delay=timedelta(hours=4))
            # More than one timer: PostgreSQL's columnar bulk insert.
            durable.schedule_many(
                [{"fn": stamped, "args": [f"b{n}"], "delay": timedelta(hours=n)} for n in (1, 2)]
            )
            run = late_signal.start()
            machine.advance(hours=20)
            signal = durable.send_signal(run.pk, "go", "now")
            machine.advance(hours=2)
        rows = {m: list(m.objects.values("pk", *_times(m))) for m in MODELS}
        rows[WorkflowStep] = list(
            WorkflowStep.objects.filter(run_id=run.pk).order_by("seq").values(*_times(WorkflowStep))
        )
        transaction.set_rollback(True)
    return {"rows": rows, "run": run.pk, "signal": signal.pk}


def _row(trip, model, pk):
    return next(row for row in trip["rows"][model] if row["pk"] == pk)


def test_a_signal_sent_at_plus_20_hours_records_that_time(trip):
    signal = _row(trip, WorkflowSignal, trip["signal"])
    assert signal["created_at"] == START + HOURS_20
    assert signal["consumed_at"] == START + HOURS_20


def test_step_rows_carry_the_checkpoints_time(trip):
    first, *_, last = trip["rows"][WorkflowStep]
    assert (first["created_at"], first["updated_at"]) == (START, START)
    # Signal at +20 h, then a one-hour sleep: the last step is checkpointed at +21 h.
    assert (last["created_at"], last["updated_at"]) == (START + timedelta(hours=21),) * 2
    run = _row(trip, WorkflowRun, trip["run"])
    assert run["created_at"] == START
    assert run["updated_at"] == run["finished_at"] == START + timedelta(hours=21)


# Times the trip's end clears again: the engine's shutdown releases its leases.
CLEARED = {"ShardLease.expires_at"}


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_time_field_follows_the_injected_clock(trip, model):
    times = _times(model)
    assert times, f"{model.__name__} has no time field"
    rows = trip["rows"][model]
    assert rows, f"the trip wrote no {model.__name__} row"
    for name in times:
        if f"{model.__name__}.{name}" not in CLEARED:
            assert any(row[name] is not None for row in rows), f"the trip never set {name}"
    for row in rows:
        for name in times:
            if row[name] is not None:
                assert START <= row[name] <= TRIP_END, (name, row[name])


def test_an_insert_without_a_stamp_takes_the_clock_and_a_given_stamp_is_kept():
    later = START + HOURS_20
    with override_clock(ManualClock(start_ms=datetime_to_ms(START))):
        run = WorkflowRun.objects.create(id="plain", name="x", shard=0)
        given = WorkflowRun.objects.create(id="given", name="x", shard=0, created_at=later)
        # bulk_create too (auto_now overwrote the checkpoint's time here, on SQLite).
        WorkflowStep.objects.bulk_create(
            [WorkflowStep(run=run, seq=1, kind="step", name="n", status="done", created_at=later)]
        )
    assert run.created_at == run.updated_at == START
    assert (given.created_at, given.updated_at) == (later, START)
    step = WorkflowStep.objects.get(run=run)
    assert (step.created_at, step.updated_at) == (later, START)
