"""Workflows when things go wrong, in the in-process worker (SQLite and PostgreSQL).

Step retries through durable timers, exhausted steps, retrying a failed run, exactly-once
atomic steps under a duplicate replay, code or rows that disappeared, non-determinism,
strict mode, fencing, and concurrent starts.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import IntegrityError, close_old_connections, connection, transaction
from django.db.models import F

import durable
from durable.dispatch.context import FireContext, current_fire, firing
from durable.exceptions import LeaseLost, WorkflowError
from durable.models import ShardLease, WorkflowRun, WorkflowStep
from durable.workflows import retry, runs
from durable.workflows.backend import DatabaseBackend
from durable.workflows.context import WorkflowContext
from durable.workflows.execute import execute
from durable.workflows.resume import resume_once
from testproject.demo.models import FireRecord, Order
from tests.integration import workflow_support as support
from tests.integration.workflow_support import START_MS, records, wake_timers

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)
FLAGS = {"new_code": False, "fixed": False}


@pytest.fixture(autouse=True)
def _reset_flags():
    FLAGS.update(new_code=False, fixed=False)


def record(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


def fail_twice(key: str) -> int:
    attempt = FireRecord.objects.filter(key__startswith=f"{key}:try").count() + 1
    record(f"{key}:try{attempt}")  # an outside effect: stays even when the attempt fails
    if attempt <= 2:
        raise ConnectionError(f"attempt {attempt} failed")
    return attempt


def fail_unless_fixed(key: str) -> str:
    if not FLAGS["fixed"]:
        raise RuntimeError(f"{key} is broken in /srv/secret/app.py")
    return "fixed"


def atomic_effect(key: str, fail: bool) -> str:
    record(key)  # inside ctx.atomic: commits with the step's record, or not at all
    if fail and not FireRecord.objects.filter(key="atomic-failures").exists():
        raise RuntimeError("fails after writing")
    return key


@durable.workflow(max_attempts=3)
def retries(ctx, key):
    return ctx.step(fail_twice, key)


@durable.workflow(max_attempts=2)
def breaks(ctx):
    value = ctx.step(fail_unless_fixed, "b")
    ctx.step(record, "after-break")
    return value


@durable.workflow
def atomic_then_sleep(ctx, key, fail=False):
    value = ctx.atomic(atomic_effect, key, fail)
    ctx.sleep(timedelta(minutes=5))
    return value


@durable.workflow
def changing(ctx):
    ctx.step(record, "first")
    if FLAGS["new_code"]:
        ctx.step(record, "inserted")
    ctx.sleep(timedelta(minutes=1))
    ctx.step(record, "last")


@durable.workflow(strict=True)
def careless(ctx):
    return time.time()


@durable.workflow
def child(ctx, seconds, fail=False):
    ctx.sleep(timedelta(seconds=seconds))
    if fail:
        raise ValueError("child gave up")
    return seconds * 2


@durable.workflow
def parent(ctx, seconds, fail=False):
    handle = ctx.start_child(child, seconds, fail=fail)
    try:
        return ctx.wait_child(handle)
    except durable.DurableError as exc:
        return f"child failed: {exc.state}: {exc.error}"


def test_a_failing_step_is_retried_through_timers_not_sleeps(driver):
    run = retries.start("r")
    driver.settle(run, "sleeping")
    step = WorkflowStep.objects.get()
    assert (step.status, step.attempts) == ("retrying", 1)
    assert "ConnectionError: attempt 1 failed" in step.error
    (timer,) = wake_timers(run)
    assert timer.key == f"wf:{run.pk}:0:a1"
    assert START_MS + 1_500 <= timer.fire_at_ms <= START_MS + 2_000  # 1 s, jittered
    run = driver.settle(run, "completed")
    assert run.result == 3 and records() == ["r:try1", "r:try2", "r:try3"]
    assert WorkflowStep.objects.get().attempts == 3


def test_an_exhausted_step_fails_the_run_and_retry_resumes_it(driver):
    run = breaks.start()
    run = driver.settle(run, "failed")
    assert "StepFailed: step 'fail_unless_fixed' (seq 0) failed after 2 attempt(s)" in run.error
    assert "/srv/secret" not in run.error
    with pytest.raises(WorkflowError, match="only failed runs can be retried"):
        retry(waiter_run := atomic_then_sleep.start("other"))
    assert waiter_run.state == "pending"
    FLAGS["fixed"] = True
    run = retry(run.pk)
    assert (run.state, run.error, run.retries) == ("pending", "", 1)
    assert not WorkflowStep.objects.filter(run=run).exists(), "the failed step gets new attempts"
    run = driver.settle(run, "completed")
    assert run.result == "fixed" and records("after") == ["after-break"]


def test_an_atomic_step_rolls_back_its_writes_when_it_fails(driver):
    run = atomic_then_sleep.start("a1", fail=True)
    driver.settle(run, "sleeping")
    step = WorkflowStep.objects.get(run=run, seq=0)
    assert step.status == "retrying" and records("a1") == []
    record("atomic-failures")  # the next attempt succeeds
    driver.until(lambda: WorkflowStep.objects.filter(run=run, seq=1).exists())
    assert records("a1") == ["a1"]
    driver.turn(timedelta(minutes=5))
    driver.settle(run, "completed")
    assert records("a1") == ["a1"], "replays never ran the recorded atomic step again"


def test_a_duplicate_replay_cannot_double_an_atomic_step(driver, clock):
    run = atomic_then_sleep.start("dup")
    driver.settle(run, "sleeping")
    assert records("dup") == ["dup"]
    # A second replay that read the history before the first one committed (a worker
    # that lost the shard but has not noticed yet, minus the fence): it runs the step
    # again and tries to record seq 0, which exists. Its whole transaction rolls back.
    WorkflowRun.objects.filter(pk=run.pk).update(state="running")
    backend = DatabaseBackend(
        db="default", run_id=run.pk, shard=run.shard, lease=None, clock=clock,
        floor_ms=0, recorded=[],
    )  # fmt: skip
    ctx = WorkflowContext(
        run_id=run.pk, history=[], backend=backend, policy=atomic_then_sleep.policy()
    )
    with pytest.raises(IntegrityError):
        execute(ctx, lambda c: atomic_then_sleep.invoke(c, None, ["dup"], {}))
    assert records("dup") == ["dup"]


def test_a_run_whose_code_is_gone_fails_and_the_worker_lives_on(driver):
    gone = atomic_then_sleep.start("gone")
    WorkflowRun.objects.filter(pk=gone.pk).update(name="shop.flows.removed_in_v2")
    fine = retries.start("fine")
    gone = driver.settle(gone, "failed")
    assert "UnknownWorkflow: unknown workflow 'shop.flows.removed_in_v2'" in gone.error
    assert [t.state for t in wake_timers(gone, "fired")] == ["fired"]
    assert driver.settle(fine, "completed").result == 3


def test_a_run_whose_row_was_deleted_fails_clearly(driver):
    order = Order.objects.create(customer="x", total_cents=1)
    run = order.fulfil.start()
    order_pk = order.pk
    order.delete()
    run = driver.settle(run, "failed")
    assert f"the Order row pk={order_pk} this run is bound to no longer exists" in run.error


def test_changed_code_fails_the_run_with_non_determinism(driver):
    run = changing.start()
    driver.settle(run, "sleeping")
    FLAGS["new_code"] = True  # a deploy inserted a step before the sleep
    driver.turn(timedelta(minutes=1))
    run = driver.settle(run, "failed")
    assert run.error.startswith("NonDeterminismError: seq 1: the history recorded sleep 'sleep'")
    assert "now calls step 'record'" in run.error
    assert records() == ["first"], "nothing ran past the mismatch"


def test_strict_mode_fails_a_run_that_reads_the_wall_clock(driver):
    run = driver.settle(careless.start(), "failed")
    assert "strict mode: time.time() is not deterministic" in run.error


def test_a_parent_is_woken_when_its_child_completes(driver):
    run = parent.start(30)
    run = driver.settle(run, "waiting")
    kid = driver.settle(WorkflowRun.objects.get(parent=run), "sleeping")
    assert kid.name == child.name
    assert wake_timers(run) == []  # waiting for the child holds no timer
    driver.turn(timedelta(seconds=30))
    assert driver.settle(run, "completed").result == 60
    assert wake_timers(run, "fired")[-1].key == f"wf:{run.pk}:child:{kid.pk}"


def test_a_failed_child_raises_in_the_parent(driver):
    run = parent.start(1, fail=True)
    run = driver.settle(run, "completed")
    assert run.result == "child failed: failed: ValueError: child gave up"


def test_cancel_cascades_to_children_and_their_timers(driver):
    run = parent.start(3600)
    run = driver.settle(run, "waiting")
    kid = driver.settle(WorkflowRun.objects.get(parent=run), "sleeping")
    assert len(wake_timers(kid)) == 1
    assert durable.cancel_workflow(run.pk) is True
    assert {r.state for r in WorkflowRun.objects.all()} == {"canceled"}
    assert wake_timers(kid) == [] and len(wake_timers(kid, "canceled")) == 1
    assert durable.cancel_workflow(run.pk) is False
    with pytest.raises(WorkflowError, match="is canceled"):
        durable.send_signal(kid.pk, "x")
    driver.turn(timedelta(hours=2))
    assert {r.state for r in WorkflowRun.objects.all()} == {"canceled"}


def test_cancelling_a_child_wakes_its_parent(driver):
    run = parent.start(3600)
    driver.settle(run, "waiting")
    durable.cancel_workflow(WorkflowRun.objects.get(parent=run))
    assert driver.settle(run, "completed").result == "child failed: canceled: "


def cancel_own_run(run_id: str) -> str:
    durable.cancel_workflow(run_id)
    return "cancelled myself"


@durable.workflow
def self_cancelling(ctx):
    ctx.step(cancel_own_run, ctx.run_id)
    ctx.step(record, "never")


def test_a_run_cancelled_during_a_step_records_nothing_more(driver):
    run = driver.settle(self_cancelling.start(), "canceled")
    assert not WorkflowStep.objects.filter(run=run).exists() and records("never") == []


def bump_lease(shard: int) -> None:
    ShardLease.objects.filter(shard=shard).update(token=F("token") + 1, owner="thief")


@durable.workflow
def fenced(ctx, shard):
    ctx.step(bump_lease, shard)  # "another worker took the shard" while this step ran
    ctx.atomic(record, "fenced-atomic")


def test_a_replay_that_lost_its_shard_commits_nothing(driver):
    run = fenced.start(0)
    WorkflowRun.objects.filter(pk=run.pk).update(args=[run.shard])
    lease = ShardLease.objects.get(shard=run.shard)
    fire = FireContext(
        timer_id=0, key=None, attempt=1, scheduled_ms=START_MS, fired_ms=START_MS,
        shard=run.shard, token=lease.token,
    )  # fmt: skip
    with firing(fire), pytest.raises(LeaseLost):
        resume_once(run.pk)
    assert not WorkflowStep.objects.exists() and records("fenced") == []
    with firing(fire), pytest.raises(LeaseLost):
        resume_once(run.pk)  # the token is stale now: the very first transaction fails
    assert WorkflowRun.objects.get(pk=run.pk).replays == 1


@pytest.mark.postgres
def test_concurrent_starts_with_one_run_id_make_one_run(clock):
    barrier = threading.Barrier(2)
    results: list[str] = []

    def start(delay_s: float) -> None:
        try:
            with transaction.atomic():
                barrier.wait()
                run = atomic_then_sleep.start("same", run_id="only-one")
                time.sleep(delay_s)  # hold the transaction open: the other waits on the key
            results.append(run.pk)
        finally:
            close_old_connections()
            connection.close()

    threads = [threading.Thread(target=start, args=(d,)) for d in (0.3, 0.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["only-one", "only-one"]
    assert runs().count() == 1 and len(wake_timers(runs().get())) == 1


def lease_seen() -> list:
    fire = current_fire()
    return [fire.shard, fire.token] if fire else []


@durable.workflow
def reports_its_lease(ctx):
    return ctx.step(lease_seen)


def test_the_worker_fences_replays_with_the_lease_it_fired_under(driver):
    run = driver.settle(reports_its_lease.start(), "completed")
    token = ShardLease.objects.get(shard=run.shard).token
    assert run.result == [run.shard, token]
