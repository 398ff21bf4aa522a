"""Keyword arguments of cron and interval schedules: declared, checked, stored, passed.

A schedule calls ``fn(occurrence, **kwargs)``. The kwargs come from the decorator, a
``CRONS`` entry or ``durable.schedules``; they are checked when declared (a JSON object
within ``MAX_PAYLOAD_BYTES`` that binds to the function's signature), stored on the
``CronSchedule`` row, and a change in code reaches the row at the next sync like any
other change of a declaration. Real engine, real database, manual clock.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

import durable
from durable.core.cron import to_ms
from durable.core.timeutil import datetime_to_ms
from durable.exceptions import ScheduleError
from durable.models import CronSchedule, Timer
from durable.scheduling import operations, schedules
from durable.scheduling.cron import Occurrence, declared, sync_declared
from durable.testing import ManualClock, override_clock
from testproject.demo.models import FireRecord

pytestmark = pytest.mark.django_db(transaction=True)

S = 1_000
START = to_ms(datetime(2030, 1, 7, 9, 0, 30, tzinfo=UTC))
GREET = "tests.integration.test_cron_kwargs.greet"


@durable.handler
def greet(occurrence: Occurrence, *, greeting: str, times: int = 1) -> None:
    """Record which kwargs this run got."""
    FireRecord.objects.create(
        key=f"{occurrence.schedule}:{greeting}:{times}",
        fired_at_ms=datetime_to_ms(occurrence.fired_at),
        due_at_ms=occurrence.scheduled_ms,
    )


def plain(occurrence: Occurrence) -> None:
    """Takes no keyword arguments."""


@pytest.fixture
def clock():
    manual = ManualClock(start_ms=START)
    with override_clock(manual):
        yield manual


@pytest.fixture
def engine(start_engine):
    return start_engine({"SHARDS": 2, "RESCAN_INTERVAL_S": 1.0}, node="kwargs-node")


def got(name: str) -> list[str]:
    """``greeting:times`` of each recorded run of schedule ``name``, in order."""
    rows = FireRecord.objects.filter(key__startswith=f"{name}:").order_by("due_at_ms", "id")
    return [r.key.split(":", 1)[1] for r in rows]


def step(engine, clock, ms: int) -> None:
    clock.advance(ms)
    engine.tick()


@pytest.mark.parametrize("atomic", [True, False])
def test_each_occurrence_receives_the_schedules_kwargs(engine, clock, atomic):
    # One name per mode: each process caches a schedule's mode by name.
    name = f"hello-{atomic}"
    row = schedules.create(
        name, GREET, every=10, atomic=atomic, kwargs={"greeting": "bonjour", "times": 3}
    )
    assert CronSchedule.objects.get(pk=row.pk).kwargs == {"greeting": "bonjour", "times": 3}
    step(engine, clock, 10 * S)
    step(engine, clock, 10 * S)
    if not atomic:  # the run happens on the engine's executor, outside the tick
        engine.executor.shutdown(wait=True)
    assert got(name) == ["bonjour:3", "bonjour:3"]


def test_update_changes_the_kwargs_of_the_next_runs(engine, clock):
    schedules.create("hello", GREET, every=10, kwargs={"greeting": "hi"})
    for _ in range(11):  # the occurrence at :40, seen and fired a tick later
        step(engine, clock, S)
    assert got("hello") == ["hi:1"]
    pending = list(Timer.objects.filter(kind="cron", state="pending").values_list("pk", flat=True))
    schedules.update("hello", kwargs={"greeting": "salut", "times": 2})
    # Not a new calendar: the pending occurrence stays, and runs with the new kwargs.
    still = Timer.objects.filter(kind="cron", state="pending").values_list("pk", flat=True)
    assert list(still) == pending
    for _ in range(10):
        step(engine, clock, S)
    assert got("hello") == ["hi:1", "salut:2"]
    with pytest.raises(ScheduleError, match=r"^schedule 'hello': kwargs: .*'colour'") as caught:
        schedules.update("hello", kwargs={"greeting": "x", "colour": "red"})
    assert caught.value.check_id == "durable.E018"
    assert CronSchedule.objects.get(name="hello").kwargs == {"greeting": "salut", "times": 2}


def test_run_now_passes_the_kwargs(engine, clock):
    schedules.create("hello", GREET, cron="0 9 * * *", kwargs={"greeting": "now"})
    operations.run_schedule_now("hello")
    step(engine, clock, S)
    assert got("hello") == ["now:1"]


def test_a_change_of_kwargs_in_code_is_picked_up_by_the_sync(engine, clock):
    try:
        durable.every(10, name="greeter", kwargs={"greeting": "v1"})(greet)
        spec = [s for s in declared.specs() if s.name == "greeter"]
        assert sync_declared(now_ms=clock.now_ms(), specs=spec).created == ["greeter"]
        step(engine, clock, 10 * S)
        next_ms = CronSchedule.objects.get(name="greeter").next_ms
        # The module is edited and re-imported: the same function, new kwargs.
        durable.every(10, name="greeter", kwargs={"greeting": "v2", "times": 5})(greet)
        spec = [s for s in declared.specs() if s.name == "greeter"]
        report = sync_declared(now_ms=clock.now_ms(), specs=spec)
        assert report.updated == ["greeter"]
        row = CronSchedule.objects.get(name="greeter")
        assert row.kwargs == {"greeting": "v2", "times": 5}
        assert row.declaration["kwargs"] == {"greeting": "v2", "times": 5}
        assert row.next_ms == next_ms  # the calendar did not change
        assert sync_declared(now_ms=clock.now_ms(), specs=spec).unchanged == 1
        step(engine, clock, 10 * S)
        assert got("greeter") == ["v1:1", "v2:5"]
    finally:
        declared.unregister("greeter")


def test_crons_entries_take_kwargs(clock, settings):
    entry = {"task": GREET, "every": 60, "kwargs": {"greeting": "from settings"}}
    settings.DURABLE = {"CRONS": {"configured": entry}}
    assert sync_declared(now_ms=START).created == ["configured"]
    assert CronSchedule.objects.get(name="configured").kwargs == {"greeting": "from settings"}
    settings.DURABLE = {"CRONS": {"configured": {**entry, "kwargs": {"greeting": "changed"}}}}
    assert sync_declared(now_ms=START).updated == ["configured"]
    assert CronSchedule.objects.get(name="configured").kwargs == {"greeting": "changed"}


def test_a_schedule_without_kwargs_keeps_its_old_declaration(clock):
    # Rows synced before kwargs existed hold declarations without the key: no spurious
    # "updated" at the first sync after the upgrade.
    schedules_spec = durable.every(60, name="old-style")(plain)
    try:
        spec = [s for s in declared.specs() if s.name == "old-style"]
        sync_declared(now_ms=START, specs=spec)
        assert "kwargs" not in CronSchedule.objects.get(name="old-style").declaration
        assert sync_declared(now_ms=START, specs=spec).unchanged == 1
    finally:
        declared.unregister("old-style")
    assert schedules_spec is plain


@pytest.mark.parametrize(
    ("kwargs", "check_id", "message"),
    [
        (["greeting"], "durable.E018", "kwargs: expected a dict of JSON values, got list"),
        ({"greeting": {1, 2}}, "durable.E018", "kwargs\\['greeting'\\]: "),
        ({"greeting": datetime(2030, 1, 1)}, "durable.E018", "kwargs\\['greeting'\\]: "),
        ({1: "x"}, "durable.E018", "kwargs"),
        ({"greeting": "x" * 300}, "durable.E018", "kwargs: 3\\d\\d bytes of JSON; the limit is "),
        ({"greeting": "hi", "colour": "red"}, "durable.E018", "kwargs: .*'colour'"),
        ({"occurrence": 1, "greeting": "hi"}, "durable.E018", "kwargs: .*multiple values"),
        (
            {},
            "durable.E016",
            "handler: .*greet\\(occurrence\\) cannot be called: .*'greeting'.*kwargs=",
        ),
    ],
)
def test_bad_kwargs_are_refused_where_declared(settings, kwargs, check_id, message):
    settings.DURABLE = {"MAX_PAYLOAD_BYTES": 256}
    where = "@durable.every on tests.integration.test_cron_kwargs.greet"
    with pytest.raises(ScheduleError, match=f"^{where}: {message}") as caught:
        durable.every(60, kwargs=kwargs)(greet)
    assert caught.value.check_id == check_id
    with pytest.raises(ScheduleError, match=f"^schedule 'api': {message}"):
        schedules.create("api", GREET, every=60, kwargs=kwargs)
    entry = {"task": GREET, "every": 60, "kwargs": kwargs}
    settings.DURABLE = {"MAX_PAYLOAD_BYTES": 256, "CRONS": {"conf": entry}}
    from durable.checks import check_crons

    errors = check_crons()
    assert [e.id for e in errors] == [check_id]
    assert errors[0].msg.startswith("DURABLE['CRONS']['conf']: ")
    assert not CronSchedule.objects.exists()


def test_a_function_without_keyword_parameters_refuses_kwargs():
    with pytest.raises(ScheduleError, match=r"kwargs: .*plain\(occurrence, \*\*kwargs\)"):
        durable.cron("0 9 * * *", kwargs={"x": 1})(plain)


def test_the_admin_shows_a_schedules_kwargs(client, clock):
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    row = schedules.create("hello", GREET, every=timedelta(hours=1), kwargs={"greeting": "olá"})
    page = client.get(reverse("admin:durable_cronschedule_change", args=[row.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    assert "Kwargs" in text and "olá" in text
