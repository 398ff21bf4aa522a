"""Workflows end to end in the in-process worker, driven by a manual clock (SQLite and PostgreSQL).

Starting (transactional, idempotent, bound to a row), the order workflow of the tutorial,
durable sleeps across days of manual time, signals before and after the wait, timeouts,
class-style workflows and bulk starts.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, transaction

import durable
from durable.conf import get_settings
from durable.core.sharding import shard_for
from durable.exceptions import SignalTimeout, UnknownWorkflow, WorkflowError
from durable.models import Timer, WorkflowRun, WorkflowSignal, WorkflowStep
from durable.workflows import get_result, runs
from durable.workflows.resume import resume_once
from testproject.demo.models import FireRecord, Order
from tests.integration import workflow_support as support
from tests.integration.workflow_support import START_MS, records, wake_timers

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)
DAY = timedelta(days=1)


def record(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


@durable.workflow
def hello(ctx, name):
    greeting = ctx.step(record, f"hello:{name}")
    ctx.sleep(timedelta(days=3))
    ctx.step(record, f"again:{name}")
    return greeting


@durable.workflow
def waiter(ctx, timeout_s=None):
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    try:
        payload = ctx.wait_for_signal("go", timeout=timeout)
    except SignalTimeout:
        return "timed out"
    ctx.atomic(record, f"go:{payload}")
    return payload


class Tally(durable.Workflow):
    """A class-style workflow: adds numbers in steps."""

    def run(self, ctx, numbers):
        total = 0
        for number in numbers:
            total = ctx.step(add, total, number)
        return total


def add(a: int, b: int) -> int:
    return a + b


def test_start_writes_the_run_and_its_timer_in_the_callers_transaction(clock):
    with pytest.raises(RuntimeError), transaction.atomic():
        hello.start("ghost")
        assert WorkflowRun.objects.count() == 1
        raise RuntimeError("roll back")
    assert not WorkflowRun.objects.exists() and not Timer.objects.exists()
    run = hello.start("ann")
    assert (run.state, run.args, run.name) == ("pending", ["ann"], hello.name)
    assert run.shard == shard_for(run.pk, get_settings().SHARDS)
    (timer,) = wake_timers(run)
    assert (timer.key, timer.kind, timer.fire_at_ms) == (f"wf:{run.pk}:start", "workflow", START_MS)
    assert timer.shard == run.shard


@pytest.mark.postgres
def test_start_outside_a_transaction_is_one_statement_that_notifies(clock):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with connection.cursor() as cursor:
        cursor.execute("LISTEN durable_timers")
    with CaptureQueriesContext(connection) as queries:
        run = hello.start("ann")
    assert len(queries) == 1 and "pg_notify" in queries[0]["sql"]
    (timer,) = wake_timers(run)
    notices = [n.payload for n in connection.connection.notifies(timeout=1, stop_after=1)]
    assert notices == [f"{timer.shard},{timer.pk},{timer.fire_at_ms}"]
    assert WorkflowRun.objects.get(pk=run.pk).created_at is not None
    with connection.cursor() as cursor:
        cursor.execute("UNLISTEN durable_timers")


def test_a_run_id_makes_start_idempotent(clock):
    first = hello.start("ann", run_id="greet-ann")
    again = hello.start("bob", run_id="greet-ann")
    assert again.pk == first.pk == "greet-ann" and again.args == ["ann"]
    assert WorkflowRun.objects.count() == 1 and Timer.objects.count() == 1


def test_a_model_method_run_is_bound_to_its_row(clock):
    order = Order.objects.create(customer="ann", total_cents=1200)
    run = order.fulfil.start()
    assert (run.model_label, run.object_pk) == ("demo.order", str(order.pk))
    assert list(WorkflowRun.objects.for_object(order)) == [run]


def test_the_order_workflow_end_to_end(driver):
    order = Order.objects.create(customer="ann", total_cents=1200)
    run = order.fulfil.start()
    driver.settle(run, "waiting")
    order.refresh_from_db()
    assert order.status == "paid" and order.payment_ref == f"pay-{order.pk}-1200"
    durable.send_signal(run.pk, "shipped", {"tracking": "TRK-1"})
    driver.settle(run, "sleeping")
    assert Order.objects.get().status == "shipped"
    driver.turn(timedelta(days=14) - timedelta(seconds=2))
    assert driver.state(run) == "sleeping", "woke early"
    run = driver.settle(run, "completed")
    assert run.result == "done" and get_result(run.pk) == "done"
    assert Order.objects.get().status == "done"
    assert records() == [f"charge:{order.pk}:{run.pk}:1", f"review-mail:{order.pk}"]
    kinds = list(WorkflowStep.objects.order_by("seq").values_list("kind", flat=True))
    assert kinds == ["atomic", "step", "atomic", "signal", "atomic", "sleep", "step", "atomic"]
    assert not wake_timers(run)


def test_the_order_is_refunded_when_shipping_times_out(driver):
    order = Order.objects.create(customer="bob", total_cents=500)
    run = order.fulfil.start()
    driver.settle(run, "waiting")
    driver.turn(timedelta(days=3))
    run = driver.settle(run, "completed")
    assert run.result == "canceled" and Order.objects.get().status == "canceled"
    assert records("refund") == [f"refund:pay-{order.pk}-500"]


def test_a_three_day_sleep_holds_nothing_and_resumes_on_time(driver):
    run = hello.start("cat")
    driver.settle(run, "sleeping")
    (timer,) = wake_timers(run)
    assert timer.fire_at_ms == START_MS + 1_000 + 3 * 86_400_000
    # Three days is beyond the workers' horizon: not even the wheel holds it.
    assert all(timer.pk not in runner.wheel for runner in driver.engine.runners.values())
    driver.turn(3 * DAY - timedelta(seconds=1))
    assert driver.state(run) == "sleeping" and records() == ["hello:cat"]
    run = driver.settle(run, "completed")
    assert run.result == "hello:cat" and records() == ["again:cat", "hello:cat"]


def test_a_signal_sent_before_the_wait_is_kept(driver):
    run = waiter.start()
    durable.send_signal(run, "go", "early")  # the run has not even started
    run = driver.settle(run, "completed")
    assert run.result == "early" and records() == ["go:early"]
    signal = WorkflowSignal.objects.get()
    assert signal.consumed_seq == 0 and signal.consumed_at is not None


def test_a_signal_after_the_wait_wakes_the_run_and_a_rolled_back_one_does_not(driver):
    run = waiter.start()
    run = driver.settle(run, "waiting")
    assert (run.wait_signal, run.wait_seq) == ("go", 0)
    with pytest.raises(RuntimeError), transaction.atomic():
        durable.send_signal(run.pk, "go", "ghost")
        raise RuntimeError("roll back")
    for _ in range(3):
        driver.turn()
    assert driver.state(run) == "waiting" and not WorkflowSignal.objects.exists()
    durable.send_signal(run.pk, "go", "late")
    assert driver.settle(run, "completed").result == "late"


def test_a_wait_times_out(driver):
    run = waiter.start(timeout_s=60)
    driver.settle(run, "waiting")
    driver.turn(timedelta(seconds=58))
    assert driver.state(run) == "waiting"
    assert driver.settle(run, "completed").result == "timed out"


def test_signals_to_unknown_or_finished_runs_are_errors(driver):
    with pytest.raises(UnknownWorkflow, match="no workflow run with id 'nope'"):
        durable.send_signal("nope", "go")
    run = waiter.start(timeout_s=1)
    driver.settle(run, "completed")
    with pytest.raises(WorkflowError, match="is completed; it takes no more signals"):
        durable.send_signal(run.pk, "go")
    with pytest.raises(ValueError, match="payload"):
        durable.send_signal(run.pk, "go", object())


def test_class_workflows_and_bulk_starts(driver):
    started = Tally.start_many(
        [{"args": [[i, i, i]], "run_id": f"tally-{i}"} for i in range(30)]
        + [{"kwargs": {"numbers": [5]}}]
    )
    assert len(started) == 31 and started[3].pk == "tally-3"
    assert Timer.objects.filter(kind="workflow").count() == 31
    again = Tally.start_many([{"args": [[9]], "run_id": "tally-3"}])
    assert again[0].args == [[3, 3, 3]] and WorkflowRun.objects.count() == 31
    with pytest.raises(ValueError, match=r"calls\[1\]\.run_id: 'x' repeats calls\[0\]"):
        Tally.start_many([{"run_id": "x", "args": [[]]}, {"run_id": "x", "args": [[]]}])
    driver.until(lambda: not runs().active().exists())
    assert get_result("tally-7") == 21 and get_result(started[-1].pk) == 5
    assert runs().named(Tally).filter(state="completed").count() == 31


def test_reading_results_and_listing_runs(driver):
    run = waiter.start()
    with pytest.raises(WorkflowError, match="is pending") as info:
        get_result(run.pk)
    assert info.value.state == "pending"
    assert list(runs().active().named(waiter)) == [run]
    assert not runs().finished().exists()
    with pytest.raises(UnknownWorkflow):
        get_result("missing")


def test_get_result_waits_for_the_run_to_finish(driver):
    run = waiter.start()
    began = time.monotonic()
    with pytest.raises(WorkflowError, match="is pending"):
        get_result(run.pk, timeout=0.05)  # nobody runs it: waits, then says where it stands
    assert time.monotonic() - began >= 0.05
    driver.turn()  # it waits for its signal now

    def finish_it():  # another process would: signal it and replay it to its end
        try:
            durable.send_signal(run.pk, "go", "now")
            resume_once(run.pk)
        finally:
            connection.close()

    sender = threading.Timer(0.1, finish_it)
    sender.start()
    try:
        assert get_result(run.pk, timeout=10) == "now"  # finished while we waited
    finally:
        sender.join()
    assert get_result(run.pk, timeout=0) == "now"
    with pytest.raises(UnknownWorkflow):
        get_result("missing", timeout=0.01)
    for bad in (-1, "1", True):
        with pytest.raises(ValueError, match="timeout: expected a number of seconds >= 0"):
            get_result(run.pk, timeout=bad)
