"""Bad input is refused at the call, naming the argument, before anything is written.

Issue 18's "bad input" list: instants past year 9999, arguments that do not fit the
handler, NUL and lone surrogates in names and keys, attempt counts past the column,
ints too long for JSON and payloads past their limit. Each test checks the error and
that the database holds nothing afterwards (on SQLite most of these would be written,
on PostgreSQL they failed in the database: either way the call must refuse them).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.test.utils import override_settings

import durable
from durable.exceptions import PayloadError
from durable.models import Timer, WorkflowRun, WorkflowSignal
from durable.scheduling import operations
from durable.scheduling.celery import schedule_celery
from durable.testing import ManualClock, override_clock
from durable.workflows import get_result

NOW = 1_900_000_000_000
pytestmark = pytest.mark.django_db
BACKEND = "durable.tasks.DurableBackend"
MAX_INSTANT = datetime(9999, 12, 30, tzinfo=UTC)  # the documented bound
BAD_TEXT = [pytest.param("a\x00b", id="nul"), pytest.param("a\ud800b", id="surrogate")]


@durable.handler
def one_arg(key: str) -> str:
    """A handler taking exactly one argument."""
    return key


@durable.handler
def anything(*args: Any, **kwargs: Any) -> None:
    """A handler taking any arguments."""


@durable.workflow
def tiny(ctx: Any, name: str = "x") -> str:
    """A workflow that waits for a signal."""
    return str(ctx.wait_for_signal("go"))


@pytest.fixture(autouse=True)
def clock():
    with override_clock(ManualClock(start_ms=NOW)) as manual:
        yield manual


def nothing_written() -> bool:
    return not Timer.objects.exists() and not WorkflowRun.objects.exists()


# -- 1. instants past year 9999 -------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"delay": timedelta(days=3_652_500)}, "delay"),
        ({"delay": timedelta.max}, "delay"),
        ({"at": datetime.max.replace(tzinfo=UTC)}, "at"),
        ({"at": datetime.max.replace(tzinfo=timezone(timedelta(hours=-5)))}, "at"),
        ({"at": MAX_INSTANT + timedelta(milliseconds=1)}, "at"),
    ],
)
def test_schedule_refuses_instants_after_the_bound(options, name):
    with pytest.raises(ValueError, match=rf"^{name}: .* is after 9999-12-30T00:00:00\+00:00"):
        durable.schedule(one_arg, args=["k"], **options)
    with pytest.raises(ValueError, match=rf"^specs\[1\]\.{name}: "):
        durable.schedule_many(
            [{"fn": one_arg, "args": ["a"]}, {"fn": one_arg, "args": ["b"], **options}]
        )
    with pytest.raises(ValueError, match=rf"^{name}: "):
        schedule_celery("app.task", **options)
    assert nothing_written()


def test_the_bound_itself_is_accepted_and_reads_back():
    timer = durable.schedule(one_arg, args=["k"], at=MAX_INSTANT)
    assert Timer.objects.get(pk=timer.pk).fire_at_ms == timer.fire_at_ms


def test_reschedule_refuses_instants_after_the_bound_and_keeps_the_timer():
    timer = durable.schedule(one_arg, args=["k"], delay=timedelta(hours=1))
    with pytest.raises(ValueError, match=r"^delay: "):
        operations.reschedule(timer, delay=timedelta.max)
    with pytest.raises(ValueError, match=r"^at: "):
        operations.reschedule(timer, at=datetime.max.replace(tzinfo=UTC))
    row = Timer.objects.get(pk=timer.pk)
    assert (row.state, row.fire_at_ms) == ("pending", NOW + 3_600_000)
    assert Timer.objects.count() == 1


def test_reschedule_rounds_a_delay_up_never_early():
    timer = durable.schedule(one_arg, args=["k"], delay=timedelta(hours=1))
    moved = operations.reschedule(timer, delay=timedelta(microseconds=1500))
    assert moved is not None and moved.fire_at_ms == NOW + 2


def test_a_task_run_after_the_bound_is_refused(settings):
    settings.TASKS = {"default": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"]}}
    from tests.integration import tasks_support

    late = tasks_support.add.using(run_after=datetime.max.replace(tzinfo=UTC))
    with pytest.raises(ValueError, match=r"^run_after: .* is after 9999-12-30"):
        late.enqueue(1, 2)
    assert nothing_written()


# -- 2. arguments that do not fit the handler ---------------------------------------------


def test_schedule_binds_args_to_the_handler_signature():
    with pytest.raises(
        TypeError, match=r"^args/kwargs: do not fit handler .*one_arg\(key\): too many positional"
    ):
        durable.schedule(one_arg, args=[1, 2, 3])
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'other'"):
        durable.schedule(one_arg, kwargs={"key": "k", "other": 1})
    with pytest.raises(TypeError, match=r"missing a required argument: 'key'"):
        durable.schedule(one_arg)
    with pytest.raises(TypeError, match=r"^specs\[1\]\.args/specs\[1\]\.kwargs: do not fit"):
        durable.schedule_many([{"fn": one_arg, "args": ["a"]}, {"fn": one_arg, "args": []}])
    assert nothing_written()


def test_handlers_taking_star_args_take_anything():
    durable.schedule(anything, args=[1, 2, 3], kwargs={"x": 1})
    durable.schedule(one_arg, kwargs={"key": "by name"})
    assert Timer.objects.count() == 2


def test_a_task_enqueue_binds_args_to_the_function(settings):
    settings.TASKS = {"default": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"]}}
    from tests.integration import tasks_support

    with pytest.raises(
        TypeError, match=r"^args/kwargs: do not fit task .*add\(a, b, \*, key='add'\): too many"
    ):
        tasks_support.add.enqueue(1, 2, 3)
    assert nothing_written()


# -- 3. NUL and lone surrogates -----------------------------------------------------------


@pytest.mark.parametrize("text", BAD_TEXT)
def test_text_that_no_column_can_hold_is_refused_naming_the_argument(text):
    with pytest.raises(ValueError, match=r"^key: str contains"):
        durable.schedule(one_arg, args=["k"], key=text)
    with pytest.raises(ValueError, match=r"^specs\[0\]\.key: str contains"):
        durable.schedule_many([{"fn": one_arg, "args": ["k"], "key": text}])
    with pytest.raises(ValueError, match=r"^run_id: str contains"):
        tiny.start(run_id=text)
    with pytest.raises(ValueError, match=r"^calls\[0\]\.run_id: str contains"):
        tiny.start_many([{"run_id": text}])
    with pytest.raises(ValueError, match=r"^task_name: str contains"):
        schedule_celery(f"app.{text}")
    with pytest.raises(ValueError, match=r"^queue: str contains"):
        schedule_celery("app.task", queue=text)
    with pytest.raises(ValueError, match=r"^name: str contains"):
        operations.run_schedule_now(text)
    assert nothing_written()


@pytest.mark.parametrize("text", BAD_TEXT)
def test_signal_names_and_run_ids_are_checked_before_the_database(text):
    run = tiny.start(run_id="r1")
    with pytest.raises(ValueError, match=r"^name: str contains"):
        durable.send_signal(run, text)
    with pytest.raises(ValueError, match=r"^run_id: str contains"):
        durable.send_signal(text, "go")
    with pytest.raises(ValueError, match=r"^run_id: str contains"):
        durable.cancel_workflow(text)
    with pytest.raises(ValueError, match=r"^run_id: str contains"):
        get_result(text)
    assert not WorkflowSignal.objects.exists()


@pytest.mark.parametrize("text", BAD_TEXT)
def test_a_workflow_name_is_checked_when_declared(text):
    with pytest.raises(ValueError, match=r"^name: str contains"):
        durable.workflow(name=f"wf{text}")(tiny.fn)


# -- 4. max_attempts past the 32-bit column -------------------------------------------------


def test_max_attempts_past_the_column_is_refused_everywhere(settings):
    with pytest.raises(ValueError, match=r"^max_attempts: must be at most 2,147,483,647"):
        durable.schedule(one_arg, args=["k"], max_attempts=2**40)
    with pytest.raises(ValueError, match=r"^specs\[0\]\.max_attempts: must be at most"):
        durable.schedule_many([{"fn": one_arg, "args": ["k"], "max_attempts": 2**31}])
    with pytest.raises(ValueError, match=r"^max_attempts: must be at most"):
        schedule_celery("app.task", max_attempts=2**40)
    with pytest.raises(ValueError, match=r"^max_attempts: must be at most"):
        durable.handler(max_attempts=2**40)
    with pytest.raises(ValueError, match=r"^max_attempts: must be at most"):
        durable.workflow(max_attempts=2**40)(tiny.fn)
    assert durable.schedule(one_arg, args=["k"], max_attempts=2**31 - 1).max_attempts == 2**31 - 1
    assert Timer.objects.count() == 1


def test_a_tasks_backend_with_too_many_attempts_is_refused(settings):
    from durable.tasks import DurableBackend

    with pytest.raises(
        ValueError, match=r"^TASKS\['default'\]\['OPTIONS'\]\.MAX_ATTEMPTS: must be at most"
    ):
        DurableBackend("default", {"OPTIONS": {"MAX_ATTEMPTS": 2**40}})


# -- 5. backoff -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backoff",
    [
        pytest.param(lambda: durable.Backoff(base_s=float("inf"), max_s=float("inf")), id="inf"),
        pytest.param(lambda: durable.Backoff(base_s=1e17, max_s=1e17), id="1e17"),
        pytest.param(lambda: durable.Backoff(base_s=1, max_s=float("nan")), id="nan"),
    ],
)
def test_a_backoff_out_of_bounds_cannot_be_built(backoff):
    with pytest.raises(ValueError, match=r"must be > 0 and <= 31,536,000 s \(365 days\)"):
        backoff()


# -- 6. payloads ------------------------------------------------------------------------------


def test_an_int_too_long_for_json_is_a_payload_error_naming_its_path():
    with pytest.raises(PayloadError, match=r"^args\[0\]: int has more than 4300 digits"):
        durable.schedule(anything, args=[10**5000])
    with pytest.raises(PayloadError, match=r"^specs\[0\]\.kwargs\['n'\]\[1\]: int has more"):
        durable.schedule_many([{"fn": anything, "kwargs": {"n": [1, -(10**4300)]}}])
    with pytest.raises(PayloadError, match=r"^args\[0\]: float nan is not JSON"):
        durable.schedule(anything, args=[float("nan")])
    assert nothing_written()
    durable.schedule(anything, args=[10**4300 - 1, -(10**4300 - 1)])  # 4300 digits: fine


# -- 8. signal payloads -----------------------------------------------------------------------


def test_a_signal_payload_past_max_payload_bytes_is_refused_at_the_call():
    run = tiny.start(run_id="r1")
    with pytest.raises(
        PayloadError,
        match=r"^payload: 70002 bytes of JSON; the limit is DURABLE\['MAX_PAYLOAD_BYTES'\] = 6553",
    ):
        durable.send_signal(run, "go", "x" * 70_000)
    with override_settings(DURABLE={"MAX_PAYLOAD_BYTES": 10}):
        with pytest.raises(PayloadError, match=r"^payload: 12 bytes"):
            durable.send_signal(run, "go", "x" * 10)
        durable.send_signal(run, "go", "x" * 8)
    assert WorkflowSignal.objects.count() == 1


def test_an_on_complete_handler_must_take_the_follow_up_keywords():
    with pytest.raises(TypeError, match=r"^on_complete: do not fit handler .*one_arg\(key\): "):
        durable.schedule(anything, on_complete=one_arg)
    with pytest.raises(TypeError, match=r"^specs\[0\]\.on_complete: do not fit handler"):
        durable.schedule_many([{"fn": anything, "on_complete": one_arg}])
    assert nothing_written()
    durable.schedule(anything, on_complete=anything)
    durable.schedule(anything, on_complete="testproject.demo.handlers.on_done")
    assert Timer.objects.count() == 2


def test_a_scheduled_signal_after_the_bound_is_refused():
    run = tiny.start(run_id="r1")
    with pytest.raises(ValueError, match=r"^delay: .* is after 9999-12-30"):
        durable.send_signal(run, "go", delay=timedelta.max)
    with pytest.raises(ValueError, match=r"^at: .* is after 9999-12-30"):
        durable.send_signal(run, "go", at=datetime.max.replace(tzinfo=UTC))
    with pytest.raises(PayloadError, match=r"^payload: 70002 bytes of JSON"):
        durable.send_signal(run, "go", "x" * 70_000, delay=timedelta(hours=1))
    assert Timer.objects.exclude(kind="workflow").count() == 0


@pytest.mark.parametrize("call", ["pause", "resume", "delete", "get", "update"])
@pytest.mark.parametrize("name", ["nightly\x00", "night\ud800ly"])
def test_schedule_lookups_refuse_nul_and_lone_surrogates(call, name):
    from durable import schedules

    function = getattr(schedules, call)
    with pytest.raises(ValueError, match=r"^name: "):
        function(name) if call != "update" else function(name, tz="UTC")
    with pytest.raises(TypeError, match=r"^name: expected a schedule name"):
        function(42) if call != "update" else function(42, tz="UTC")


def test_an_interval_anchor_past_9999_is_refused():
    from durable import schedules
    from durable.exceptions import ScheduleError

    far = datetime(9999, 12, 31, tzinfo=UTC)
    with pytest.raises(ScheduleError, match=r"anchor: .* is after 9999-12-30"):
        schedules.create(
            "far-anchor", handler="testproject.demo.crons.record", every=60, anchor=far
        )
    assert not durable.models.CronSchedule.objects.filter(name="far-anchor").exists()
