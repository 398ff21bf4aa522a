"""``durable.tasks.DurableBackend`` through Django's own Tasks API, run by the in-process engine.

Tasks are enqueued with ``task.enqueue(...)`` and read back with ``task.get_result(id)``
and ``result.refresh()``, exactly as an application would; the worker is the real engine
driven turn by turn with a manual clock (tasks run on its executor threads).
"""

from __future__ import annotations

import time

import pytest
from django.db import transaction

import durable
from durable.exceptions import PayloadError
from durable.models import Timer
from durable.tasks import (
    InvalidTaskError,
    TaskCanceled,
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


def test_priority_and_queue_round_trip(tasks, engine, clock):
    result = tasks.send_email.enqueue("ana@example.com")
    assert (result.task.priority, result.task.queue_name) == (10, "emails")
    bumped = tasks.send_email.using(priority=-5).enqueue("bo@example.com")
    run(engine, clock)
    got = tasks.send_email.get_result(bumped.id)
    assert (got.task.priority, got.task.queue_name) == (-5, "emails")
    assert got.return_value == {"sent": "bo@example.com"}


def test_unknown_queue_is_rejected_by_the_backend(tasks, settings):
    settings.TASKS = {"default": {"BACKEND": BACKEND}}  # QUEUES: only "default"
    with pytest.raises(InvalidTaskError, match="emails"):
        tasks.send_email.enqueue("x@example.com")
    assert Timer.objects.count() == 0


def test_non_json_arguments_are_rejected_at_enqueue(tasks):
    with pytest.raises(PayloadError, match=r"args\[0\]: set is not JSON"):
        tasks.add.enqueue({1, 2}, 3)
    with pytest.raises(PayloadError, match=r"kwargs\['key'\]"):
        tasks.add.enqueue(1, 2, key=b"bytes")
    assert Timer.objects.count() == 0


def test_a_non_json_return_value_fails_the_run(tasks, engine, clock):
    result = tasks.not_json.enqueue("nj")
    run(engine, clock)
    got = tasks.not_json.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED
    assert "return value: object is not JSON" in got.errors[0].traceback


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
