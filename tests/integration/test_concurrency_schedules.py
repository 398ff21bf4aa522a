"""A schedule never runs a limited handler outside its key's limits (issue 19).

A cron or interval occurrence calls its function directly, ``fn(occurrence, **kwargs)``,
so a ``@durable.handler(concurrency_key=...)`` named by a schedule would run over its
limits. It is refused where the schedule is declared (decorators in either order,
``durable.schedules``, ``CRONS``), and a row made before the handler got its limit
fails its runs visibly instead of running. Real engine, real database, manual clock.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

import durable
from durable.core.cron import to_ms
from durable.core.timeutil import datetime_to_ms
from durable.dispatch.concurrency import policy
from durable.dispatch.registry import handlers
from durable.exceptions import ScheduleError
from durable.models import CronSchedule
from durable.scheduling import schedules
from durable.scheduling.cron import Occurrence, declared, functions
from durable.scheduling.specs import settings_spec
from durable.testing import ManualClock, override_clock
from testproject.demo.models import FireRecord

pytestmark = pytest.mark.django_db(transaction=True)

S = 1_000
START = to_ms(datetime(2030, 1, 7, 9, 0, 30, tzinfo=UTC))
HERE = "tests.integration.test_concurrency_schedules"
REFUSED = "a schedule would call it directly, outside its key's limits"


@durable.handler(concurrency_key="nightly", max_concurrency=1)
def limited(occurrence: Occurrence) -> None:
    """A limited handler that could take an occurrence."""
    FireRecord.objects.create(key="limited", fired_at_ms=datetime_to_ms(occurrence.fired_at))


@durable.handler
def unlimited(occurrence: Occurrence) -> None:
    """Given a limit by a later deploy, in the test of stored rows."""
    FireRecord.objects.create(key="unlimited", fired_at_ms=datetime_to_ms(occurrence.fired_at))


def scheduled_first(occurrence: Occurrence) -> None:
    """Declared a schedule, then a limited handler (the decorators' other order)."""


@pytest.fixture
def clock():
    manual = ManualClock(start_ms=START)
    with override_clock(manual):
        yield manual


def test_a_run_time_schedule_of_a_limited_handler_is_refused_and_writes_nothing():
    with pytest.raises(ScheduleError, match=REFUSED) as caught:
        schedules.create("sync", f"{HERE}.limited", every=60)
    assert f"{HERE}.limited is declared with @durable.handler(concurrency_key=...)" in str(
        caught.value
    )
    assert "durable.schedule(limited, ...)" in str(caught.value)
    assert not CronSchedule.objects.exists()


def test_a_decorated_or_configured_schedule_of_a_limited_handler_is_refused():
    with pytest.raises(ScheduleError, match=REFUSED):
        durable.every(60, name="limited-every")(limited)
    with pytest.raises(ScheduleError, match=REFUSED):
        settings_spec("nightly", {"task": f"{HERE}.limited", "cron": "0 3 * * *"})
    assert "limited-every" not in {spec.name for spec in declared.specs()}


def test_a_limit_on_a_function_declared_as_a_schedule_is_refused():
    durable.cron("0 3 * * *", name="scheduled-first")(scheduled_first)
    try:
        with pytest.raises(ScheduleError, match="declared as a schedule") as caught:
            durable.handler(concurrency_key="k", max_concurrency=1)(scheduled_first)
        assert caught.value.check_id == "durable.E016"
        assert handlers.get(f"{HERE}.scheduled_first") is None, "not registered"
    finally:
        declared.unregister("scheduled-first")
        functions._specs.pop(f"{HERE}.scheduled_first", None)


def test_a_stored_schedule_whose_handler_got_a_limit_fails_its_runs_instead(start_engine, clock):
    engine = start_engine({"SHARDS": 2, "RESCAN_INTERVAL_S": 1.0}, node="limits-node")
    schedules.create("sync", f"{HERE}.unlimited", every=60)
    name = f"{HERE}.unlimited"
    plain = handlers.get(name)
    assert plain is not None
    # A deploy gives the handler a limit; the row made before it still names it.
    handlers.register(dataclasses.replace(plain, concurrency=policy("k", 1)))
    try:
        clock.advance(60 * S)
        engine.tick()
    finally:
        handlers.register(plain)
    row = CronSchedule.objects.get(name="sync")
    assert (row.last_status, row.failed_count, row.fired_count) == ("failed", 1, 0)
    assert REFUSED in row.last_error
    assert not FireRecord.objects.filter(key="unlimited").exists(), "it did not run"
