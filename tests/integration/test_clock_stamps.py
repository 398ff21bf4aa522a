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
from django.db import models

import durable
from durable.models import WorkflowRun, WorkflowSignal, WorkflowStep
from durable.testing import time_machine
from testproject.demo.models import FireRecord

START = datetime(2031, 3, 1, 9, 0, tzinfo=UTC)
HOURS_20 = timedelta(hours=20)
TRIP_END = START + timedelta(days=2)

pytestmark = pytest.mark.django_db


def note(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


@durable.handler
def stamped(label: str) -> None:
    note(label)


@durable.workflow
def late_signal(ctx):
    """A step at once, a signal awaited (sent at +20 h), then a step after a sleep."""
    ctx.step(note, "first")
    name = ctx.wait_for_signal("go")
    ctx.sleep(timedelta(hours=1))
    ctx.step(note, f"after:{name}")
    return name


def _trip() -> str:
    """A trip that writes a row of every durable model, with times well after START."""
    with time_machine(START) as machine:
        durable.schedules.create(
            "stamps", "testproject.demo.crons.record", every=timedelta(hours=6)
        )
        durable.schedule(stamped, args=["late"], delay=timedelta(hours=3))
        # More than one timer: PostgreSQL's columnar bulk insert.
        durable.schedule_many(
            [{"fn": stamped, "args": [f"bulk{n}"], "delay": timedelta(hours=n)} for n in (1, 2)]
        )
        run = late_signal.start()
        machine.advance(hours=20)
        durable.send_signal(run.pk, "go", "now")
        machine.advance(hours=2)
    return run.pk


def test_a_signal_sent_at_plus_20_hours_records_that_time():
    with time_machine(START) as machine:
        run = late_signal.start()
        machine.advance(hours=20)
        signal = durable.send_signal(run.pk, "go", "now")
        machine.advance(hours=2)
    assert WorkflowSignal.objects.get(pk=signal.pk).created_at == START + HOURS_20
    assert WorkflowSignal.objects.get(pk=signal.pk).consumed_at == START + HOURS_20


def test_step_rows_carry_the_checkpoints_time():
    with time_machine(START) as machine:
        run = late_signal.start()
        machine.advance(hours=20)
        durable.send_signal(run.pk, "go", "now")
        machine.advance(hours=2)
    *_, first = steps = list(WorkflowStep.objects.filter(run_id=run.pk).order_by("-seq"))
    last = steps[0]
    assert (first.created_at, first.updated_at) == (START, START)
    # Signal at +20 h, then a one-hour sleep: the last step is checkpointed at +21 h.
    assert (last.created_at, last.updated_at) == (START + timedelta(hours=21),) * 2
    finished = WorkflowRun.objects.get(pk=run.pk)
    assert finished.created_at == START
    assert finished.updated_at == finished.finished_at == START + timedelta(hours=21)


MODELS = sorted(apps.get_app_config("durable").get_models(), key=lambda m: m.__name__)
# Times the trip's end clears again: the engine's shutdown releases its leases.
CLEARED = {"ShardLease.expires_at"}


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_time_field_follows_the_injected_clock(model):
    _trip()
    times = [f.attname for f in model._meta.concrete_fields if isinstance(f, models.DateTimeField)]
    assert times, f"{model.__name__} has no time field"
    rows = list(model.objects.values(*times))
    assert rows, f"the trip wrote no {model.__name__} row"
    for name in times:
        if f"{model.__name__}.{name}" not in CLEARED:
            assert any(row[name] is not None for row in rows), f"the trip never set {name}"
    for row in rows:
        for name, value in row.items():
            if value is not None:
                assert START <= value <= TRIP_END, (name, value)
