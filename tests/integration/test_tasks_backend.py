"""``durable.tasks.DurableBackend`` through Django's own Tasks API, run by the in-process engine.

Tasks are enqueued with ``task.enqueue(...)`` and read back with ``task.get_result(id)``
and ``result.refresh()``, exactly as an application would; the worker is the real engine
driven turn by turn with a manual clock (tasks run on its executor threads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.core import checks
from django.db import transaction

import durable
from durable.exceptions import PayloadError
from durable.models import Timer
from durable.tasks import (
    MAX_TRACEBACK_CHARS,
    InvalidTaskError,
    TaskAborted,
    TaskCanceled,
    TaskPayloadError,
    TaskResultDoesNotExist,
    TaskResultStatus,
    _signals,
)
from testproject.demo.models import FireRecord

START_MS = 1_900_000_000_000
pytestmark = pytest.mark.django_db(transaction=True)
BACKEND = "durable.tasks.DurableBackend"


@pytest.fixture
def engine(start_engine):
    return start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0})


@pytest.fixture
def tasks(settings, engine):
    """The example tasks, declared once the durable backend is configured."""
    settings.TASKS = {"default": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"]}}
    from tests.integration import tasks_support

    return tasks_support


def run(engine, clock, ms=1_000):
    """One turn after ``ms`` of manual time, then wait for the tasks it started."""
    clock.advance(ms)
    engine.tick()
    deadline = time.monotonic() + 10
    while engine.firer.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.firer.in_flight


def keys():
    return sorted(FireRecord.objects.values_list("key", flat=True))


def test_enqueue_run_and_read_the_result(tasks, engine, clock):
    result = tasks.add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY and not result.is_finished
    assert result.id == str(Timer.objects.get(kind="task").pk)
    assert result.args == [2, 3] and result.backend == "default"
    run(engine, clock)
    got = tasks.add.get_result(result.id)
    assert got.status == TaskResultStatus.SUCCESSFUL
    assert got.return_value == 5
    assert got.enqueued_at and got.started_at and got.finished_at and got.last_attempted_at
    assert got.enqueued_at <= got.finished_at
    assert len(got.worker_ids) == 1 and got.attempts == 1
    result.refresh()  # the handle the caller kept catches up too
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5
    assert keys() == ["add"]


def test_enqueue_is_part_of_the_callers_transaction(tasks, engine, clock):
    with pytest.raises(RuntimeError), transaction.atomic():
        ghost = tasks.add.enqueue(1, 1, key="ghost")
        raise RuntimeError("roll back")
    run(engine, clock, 5_000)
    assert keys() == []
    with pytest.raises(TaskResultDoesNotExist):
        tasks.add.get_result(ghost.id)


def test_run_after_waits_in_the_timer_wheel(tasks, engine, clock):
    when = durable_datetime(clock.now_ms() + 3_600_000)
    result = tasks.add.using(run_after=when).enqueue(1, 2, key="later")
    run(engine, clock, 3_599_000)
    assert keys() == [] and tasks.add.get_result(result.id).status == TaskResultStatus.READY
    run(engine, clock, 1_000)
    got = tasks.add.get_result(result.id)
    assert got.status == TaskResultStatus.SUCCESSFUL and got.task.run_after == when
    record = FireRecord.objects.get(key="later")
    assert record.fired_at_ms >= record.due_at_ms == clock.now_ms()


def durable_datetime(ms):
    from durable.core.timeutil import ms_to_datetime

    return ms_to_datetime(ms)


def test_a_task_that_raises_is_failed_with_its_error(tasks, engine, clock):
    result = tasks.explode.enqueue("boom")
    run(engine, clock)
    got = tasks.explode.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED and got.is_finished
    [error] = got.errors
    assert error.exception_class is ValueError
    assert "ValueError: boom" in error.traceback
    assert "/site-packages/" not in error.traceback and "tasks_support.py" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = got.return_value
    assert Timer.objects.get(pk=int(result.id)).state == "failed"


def test_a_long_traceback_keeps_its_end(tasks, engine, clock):
    result = tasks.deep.enqueue(200)
    run(engine, clock)
    [error] = tasks.deep.get_result(result.id).errors
    assert len(error.traceback) == MAX_TRACEBACK_CHARS and error.traceback.startswith("…")
    assert error.traceback.endswith("ValueError: at the bottom\n")  # as Django's backends


def test_more_attempts_retry_with_backoff(tasks, engine, clock, settings):
    settings.TASKS = {"default": {"BACKEND": BACKEND, "OPTIONS": {"MAX_ATTEMPTS": 3}}}
    result = tasks.flaky.enqueue("f")
    run(engine, clock)
    between = tasks.flaky.get_result(result.id)
    assert between.status == TaskResultStatus.READY  # ready to run again
    assert [e.exception_class for e in between.errors] == [RuntimeError]
    for _ in range(10):
        run(engine, clock, 2_000)
    got = tasks.flaky.get_result(result.id)
    assert got.status == TaskResultStatus.SUCCESSFUL and got.return_value == "f"
    assert got.attempts == 2 and len(got.errors) == 1
    assert keys() == ["f:1", "f:2"]


def test_takes_context_and_async_tasks(tasks, engine, clock):
    ctx = tasks.with_context.enqueue("c")
    coro = tasks.asynchronous.enqueue("a")
    run(engine, clock)
    assert tasks.with_context.get_result(ctx.id).return_value == {"id": ctx.id, "attempt": 1}
    assert tasks.asynchronous.get_result(coro.id).return_value == "A"


def test_queue_round_trips(tasks, engine, clock):
    result = tasks.send_email.enqueue("ana@example.com")
    assert (result.task.priority, result.task.queue_name) == (0, "emails")
    run(engine, clock)
    got = tasks.send_email.get_result(result.id)
    assert got.task.queue_name == "emails" and got.return_value == {"sent": "ana@example.com"}


def test_priority_is_not_supported(tasks):
    # Due tasks run in due-time order, not by priority: Django then rejects a priority.
    from durable.tasks import DurableBackend

    assert DurableBackend.supports_priority is False
    with pytest.raises(InvalidTaskError, match="priority"):
        tasks.add.using(priority=5)
    with pytest.raises(InvalidTaskError, match="priority"):
        tasks.task(priority=-1)(tasks.add.func)
    tasks.add.using(priority=0).enqueue(1, 1)  # the default is accepted
    assert Timer.objects.count() == 1


def test_unknown_queue_is_rejected_by_the_backend(tasks, settings):
    settings.TASKS = {"default": {"BACKEND": BACKEND}}  # QUEUES: only "default"
    with pytest.raises(InvalidTaskError, match="emails"):
        tasks.send_email.enqueue("x@example.com")
    assert Timer.objects.count() == 0


def test_non_json_arguments_are_a_type_error_at_enqueue(tasks):
    # Django's docs: a non-JSON argument raises TypeError, and Django's own backends (and
    # tests) say "Unsupported type". Ours is both, and names the argument.
    with pytest.raises(TypeError, match=r"^Unsupported type.*args\[0\]: set is not JSON") as info:
        tasks.add.enqueue({1, 2}, 3)
    assert isinstance(info.value, PayloadError) and info.value.path == "args[0]"
    with pytest.raises(TaskPayloadError, match=r"kwargs\['key'\]"):
        tasks.add.enqueue(1, 2, key=b"bytes")
    assert Timer.objects.count() == 0


def test_too_large_arguments_stay_a_value_error(tasks, settings):
    settings.DURABLE = {**settings.DURABLE, "MAX_PAYLOAD_BYTES": 100}
    with pytest.raises(PayloadError, match="bytes of JSON") as info:
        tasks.add.enqueue("x" * 200, 1)
    assert not isinstance(info.value, TypeError)
    assert Timer.objects.count() == 0


def test_a_non_json_return_value_fails_the_run_with_a_type_error(tasks, engine, clock):
    result = tasks.not_json.enqueue("nj")
    run(engine, clock)
    got = tasks.not_json.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED
    [error] = got.errors
    assert error.exception_class is TaskPayloadError
    assert issubclass(TaskPayloadError, TypeError)
    assert "return value: object is not JSON" in error.traceback


def test_cancel_before_it_runs(tasks, engine, clock):
    result = tasks.add.using(run_after=durable_datetime(clock.now_ms() + 60_000)).enqueue(1, 1)
    assert durable.cancel(int(result.id)) is True
    got = tasks.add.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED and got.finished_at
    assert got.errors[-1].exception_class is TaskCanceled
    run(engine, clock, 120_000)
    assert keys() == []


def test_unknown_result_ids(tasks):
    timer = durable.schedule("testproject.demo.probes.record", args=["x"])
    for bad in ("nope", "999999", str(timer.pk)):  # not a number, absent, not a task
        with pytest.raises(TaskResultDoesNotExist):
            tasks.add.get_result(bad)


def test_signals_tell_enqueued_started_finished(tasks, engine, clock):
    seen = []

    def listen(sender, task_result, **kwargs):
        seen.append((kwargs["signal"], task_result.status))

    names = {_signals.task_enqueued: "enqueued", _signals.task_started: "started"}
    names[_signals.task_finished] = "finished"
    for signal in names:
        signal.connect(listen, weak=False)
    try:
        tasks.add.enqueue(1, 2)
        run(engine, clock)
    finally:
        for signal in names:
            signal.disconnect(listen)
    assert [(names[s], status) for s, status in seen] == [
        ("enqueued", TaskResultStatus.READY),
        ("started", TaskResultStatus.RUNNING),
        ("finished", TaskResultStatus.SUCCESSFUL),
    ]


@pytest.mark.parametrize(
    "kind, name", [("exit", "SystemExit"), ("interrupt", "KeyboardInterrupt"), ("halt", "Halt")]
)
def test_a_base_exception_fails_the_task_with_its_error(tasks, engine, clock, kind, name):
    # Django's own backends record SystemExit and the like as FAILED; before, the timer
    # stayed firing (RUNNING) and was re-run after every claim timeout.
    result = tasks.halts.enqueue(kind)
    run(engine, clock)
    got = tasks.halts.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED and got.finished_at and got.attempts == 1
    [error] = got.errors
    assert error.exception_class.__name__ == name
    assert f"{name}" in error.traceback and "tasks_support.py" in error.traceback
    timer = Timer.objects.get(pk=int(result.id))
    assert timer.state == "failed" and timer.attempts == 1
    assert TaskAborted.__name__ in timer.last_error  # what the worker was handed
    run(engine, clock, 600_000)  # past the claim timeout: not run again
    assert keys() == [f"halt:{kind}"]


def test_a_base_exception_is_a_counted_attempt(tasks, engine, clock, settings):
    settings.TASKS = {"default": {"BACKEND": BACKEND, "OPTIONS": {"MAX_ATTEMPTS": 2}}}
    result = tasks.halts.enqueue("exit")
    run(engine, clock)
    assert tasks.halts.get_result(result.id).status == TaskResultStatus.READY
    for _ in range(10):
        run(engine, clock, 2_000)
    got = tasks.halts.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED and got.attempts == 2
    assert [e.exception_class for e in got.errors] == [SystemExit, SystemExit]
    assert keys() == ["halt:exit", "halt:exit"]


def test_a_running_task_shows_its_start_and_attempts(tasks, engine, clock):
    tasks.STARTED.clear()
    tasks.RELEASE.clear()
    result = tasks.watch_itself.enqueue("w")
    clock.advance(1_000)
    engine.tick()
    try:
        assert tasks.STARTED.wait(10)
        result.refresh()  # the caller's view, from another thread and connection
        assert result.status == TaskResultStatus.RUNNING and not result.is_finished
        assert result.started_at is not None and result.started_at == result.last_attempted_at
        assert result.attempts == 1 and len(result.worker_ids) == 1
        assert result.finished_at is None
    finally:
        tasks.RELEASE.set()
    run(engine, clock, 0)
    got = tasks.watch_itself.get_result(result.id)
    assert got.status == TaskResultStatus.SUCCESSFUL
    assert got.return_value == {  # what the task saw of itself
        "status": "RUNNING",
        "started_at": got.started_at.isoformat(),
        "last_attempted_at": got.last_attempted_at.isoformat(),
        "attempts": 1,
        "worker_ids": got.worker_ids,
    }


def test_signals_for_a_task_that_exits(tasks, engine, clock):
    seen = []

    def listen(sender, task_result, **kwargs):
        seen.append((task_result.status, task_result.attempts, task_result.started_at))

    for signal in (_signals.task_started, _signals.task_finished):
        signal.connect(listen, weak=False)
    try:
        tasks.halts.enqueue("exit")
        run(engine, clock)
    finally:
        for signal in (_signals.task_started, _signals.task_finished):
            signal.disconnect(listen)
    [(started, one, at), (finished, also_one, same)] = seen
    assert (started, finished) == (TaskResultStatus.RUNNING, TaskResultStatus.FAILED)
    assert one == also_one == 1 and at is not None and at == same


def test_check_passes_when_durable_is_installed(tasks):
    from durable.models import TimerState
    from durable.tasks import _STATUS, DurableBackend

    backend = DurableBackend("default", {"BACKEND": BACKEND})
    assert backend.check() == []
    assert set(_STATUS) == set(TimerState.values)  # the module spells the states out


def test_check_reports_durable_missing_from_installed_apps(tmp_path):
    # A fresh process: the backend must load, and say what is wrong, without durable's
    # models (importing them outside INSTALLED_APPS is itself an error).
    (tmp_path / "no_durable_settings.py").write_text(
        "SECRET_KEY = 'x'\n"
        "USE_TZ = True\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django.contrib.auth']\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3', 'NAME': ':memory:'}}\n"
        f"TASKS = {{'default': {{'BACKEND': {BACKEND!r}}}}}\n"
    )
    script = (
        "import django\n"
        "django.setup()\n"
        "try:\n"
        "    from django.tasks import task_backends\n"
        "except ImportError:\n"
        "    from django_tasks import task_backends\n"
        "for message in task_backends['default'].check():\n"
        "    print(message.id, message.level, message.msg)\n"
    )
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "no_durable_settings",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).parents[2])]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert line.startswith(f"durable.E030 {checks.ERROR} ")
    assert "'durable' is not in INSTALLED_APPS" in line


def test_a_raising_task_started_receiver_fails_the_attempt(tasks, engine, clock):
    def refuse(sender, task_result, **kwargs):
        raise RuntimeError("not now")

    _signals.task_started.connect(refuse, weak=False)
    try:
        result = tasks.add.enqueue(1, 2)
        run(engine, clock)
    finally:
        _signals.task_started.disconnect(refuse)
    got = tasks.add.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED and got.attempts == 1
    assert [e.exception_class for e in got.errors] == [RuntimeError]
    assert keys() == []  # the task itself never ran


def test_a_task_past_the_backends_timeout_is_abandoned_and_fails(settings, engine, clock):
    settings.TASKS = {
        "default": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"], "OPTIONS": {"TIMEOUT": 2}}
    }
    from tests.integration import tasks_support as tasks

    tasks.STARTED.clear()
    tasks.RELEASE.clear()
    result = tasks.watch_itself.enqueue("slow")
    clock.advance(1_000)
    engine.tick()
    try:
        assert tasks.STARTED.wait(10)
        clock.advance(2_001)  # past OPTIONS["TIMEOUT"], on the worker's clock
        engine.tick()  # the watchdog abandons the attempt
        result.refresh()
        assert result.status == TaskResultStatus.FAILED
        timer = Timer.objects.get(pk=int(result.id))
        assert "HandlerTimeout: the handler ran past its timeout of 2 s" in timer.last_error
    finally:
        tasks.RELEASE.set()


def test_a_bad_timeout_option_names_itself():
    from durable.tasks import DurableBackend

    with pytest.raises(ValueError, match=r"TASKS\['x'\]\['OPTIONS'\]\['TIMEOUT'\]"):
        DurableBackend("x", {"OPTIONS": {"TIMEOUT": -1}})
