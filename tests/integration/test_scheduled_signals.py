"""Scheduled signals: ``send_signal(..., at=... | delay=...)`` (SQLite and PostgreSQL).

The signal is a durable timer (kind ``signal``) written in the caller's transaction; the
in-process engine, driven by a manual clock, delivers it when due (not before) exactly
as ``send_signal`` would, and the waiting run resumes. A rolled-back or cancelled one is
never delivered; one that finds its run finished is dead-lettered at once.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import transaction

import durable
from durable.exceptions import PayloadError, UnknownWorkflow, WorkflowError
from durable.models import Timer, TimerState, WorkflowSignal
from testproject.demo.models import FireRecord
from tests.integration import workflow_support as support
from tests.integration.workflow_support import START_MS

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)


def record(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


@durable.workflow
def waits_for_go(ctx):
    payload = ctx.wait_for_signal("go")
    ctx.atomic(record, f"go:{payload}")
    return payload


def signal_timers():
    return Timer.objects.filter(kind="signal")


def test_a_scheduled_signal_is_delivered_when_due_and_not_before(driver, clock):
    run = driver.settle(waits_for_go.start(), "waiting")
    sent_at = clock.now_ms()
    timer = durable.send_signal(run, "go", {"n": 1}, delay=timedelta(seconds=10))
    assert isinstance(timer, Timer)
    assert (timer.kind, timer.target, timer.args) == ("signal", run.pk, ["go", {"n": 1}])
    assert timer.fire_at_ms == sent_at + 10_000 and timer.shard == run.shard
    driver.turn(9_999)  # 1 ms early
    assert not WorkflowSignal.objects.exists()
    assert Timer.objects.get(pk=timer.pk).state == TimerState.PENDING
    assert driver.state(run) == "waiting"
    driver.turn(1)  # due now
    fired = Timer.objects.get(pk=timer.pk)
    assert (fired.state, fired.attempts) == (TimerState.FIRED, 1)
    assert WorkflowSignal.objects.get().payload == {"n": 1}
    run = driver.settle(run, "completed")
    assert run.result == {"n": 1}
    assert list(FireRecord.objects.values_list("key", flat=True)) == ["go:{'n': 1}"]


def test_at_schedules_for_that_time_and_a_past_at_means_now(driver, clock):
    run = driver.settle(waits_for_go.start(), "waiting")
    when = datetime.fromtimestamp((clock.now_ms() + 5_000) / 1000, tz=UTC)
    later = durable.send_signal(run, "other", "x", at=when)
    past = durable.send_signal(run, "go", "past", at=datetime(2000, 1, 1, tzinfo=UTC))
    assert later.fire_at_ms == clock.now_ms() + 5_000
    assert past.fire_at_ms < clock.now_ms()  # due at once
    run = driver.settle(run, "completed")
    assert run.result == "past"


def test_a_signal_scheduled_in_a_rolled_back_transaction_is_never_delivered(driver):
    run = driver.settle(waits_for_go.start(), "waiting")
    with pytest.raises(RuntimeError), transaction.atomic():
        durable.send_signal(run, "go", "ghost", delay=timedelta(seconds=1))
        assert signal_timers().count() == 1  # written in the caller's transaction
        raise RuntimeError("roll back")
    assert not signal_timers().exists()
    for _ in range(5):
        driver.turn()
    assert driver.state(run) == "waiting" and not WorkflowSignal.objects.exists()


def test_a_cancelled_scheduled_signal_is_never_delivered(driver):
    run = driver.settle(waits_for_go.start(), "waiting")
    timer = durable.send_signal(run, "go", "never", delay=timedelta(seconds=3))
    assert durable.cancel(timer) is True
    assert durable.cancel(timer) is False  # already cancelled
    for _ in range(6):
        driver.turn()
    assert Timer.objects.get(pk=timer.pk).state == TimerState.CANCELED
    assert driver.state(run) == "waiting" and not WorkflowSignal.objects.exists()


def test_a_signal_due_after_its_run_finished_is_dead_lettered_at_once(driver):
    run = driver.settle(waits_for_go.start(), "waiting")
    late = durable.send_signal(run, "go", "late", delay=timedelta(seconds=30))
    durable.send_signal(run, "go", "now")
    assert driver.settle(run, "completed").result == "now"
    driver.turn(timedelta(seconds=30))
    got = Timer.objects.get(pk=late.pk)
    assert (got.state, got.attempts) == (TimerState.FAILED, 1)
    assert "is completed; it takes no more signals" in got.last_error
    assert WorkflowSignal.objects.filter(payload="late").count() == 0


def test_an_operator_can_fire_a_scheduled_signal_now(driver):
    from durable.scheduling.operations import fire_now

    run = driver.settle(waits_for_go.start(), "waiting")
    timer = durable.send_signal(run, "go", "early", delay=timedelta(days=1))
    moved = fire_now(timer)
    assert moved is not None and (moved.kind, moved.args) == ("signal", ["go", "early"])
    assert driver.settle(run, "completed").result == "early"
    assert Timer.objects.get(pk=timer.pk).state == TimerState.CANCELED


def test_cancelling_the_run_cancels_its_scheduled_signals(driver):
    run = driver.settle(waits_for_go.start(), "waiting")
    timer = durable.send_signal(run, "go", "x", delay=timedelta(seconds=5))
    assert durable.cancel_workflow(run) is True
    assert Timer.objects.get(pk=timer.pk).state == TimerState.CANCELED


def test_bad_calls_raise_before_any_write(driver, clock, settings):
    run = driver.settle(waits_for_go.start(), "waiting")
    soon = datetime.fromtimestamp(START_MS / 1000 + 3600, tz=UTC)
    with pytest.raises(ValueError, match="at/delay: pass at most one"):
        durable.send_signal(run, "go", at=soon, delay=timedelta(seconds=1))
    with pytest.raises(ValueError, match="at: naive datetime"):
        durable.send_signal(run, "go", at=datetime(2030, 1, 1))
    with pytest.raises(TypeError, match="delay: expected a timedelta"):
        durable.send_signal(run, "go", delay=5)
    with pytest.raises(ValueError, match="delay: must not be negative"):
        durable.send_signal(run, "go", delay=timedelta(seconds=-1))
    with pytest.raises(ValueError, match="name: expected 1 to 200"):
        durable.send_signal(run, "", delay=timedelta(seconds=1))
    with pytest.raises(PayloadError, match=r"payload\['x'\]: set is not JSON"):
        durable.send_signal(run, "go", {"x": {1}}, delay=timedelta(seconds=1))
    settings.DURABLE = {**settings.DURABLE, "MAX_PAYLOAD_BYTES": 100}
    with pytest.raises(PayloadError, match="MAX_PAYLOAD_BYTES'] = 100") as info:
        durable.send_signal(run, "go", "x" * 200, delay=timedelta(seconds=1))
    assert info.value.size == 202 and info.value.limit == 100
    with pytest.raises(UnknownWorkflow, match="no workflow run with id 'nope'"):
        durable.send_signal("nope", "go", delay=timedelta(seconds=1))
    durable.cancel_workflow(run)
    with pytest.raises(WorkflowError, match="is canceled; it takes no more signals"):
        durable.send_signal(run, "go", delay=timedelta(seconds=1))
    assert not signal_timers().exists()
