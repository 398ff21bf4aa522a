"""Wake-ups replayed inside the firing batch, and histories handed over to the executor.

A sleep that ends and code that then returns or sleeps again is replayed by the firing
thread in the batch transaction (no executor, no checkpoint transactions); a replay that
reaches a step goes to the executor with the history the batch read. SQLite and PostgreSQL.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

import durable
from durable.models import ShardLease, Timer, WorkflowRun, WorkflowStep
from durable.storage import firing, wakeups
from tests.integration import workflow_support as support
from tests.integration.workflow_support import records

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)
THREADS: list[str] = []  # which thread ran each replay's end (a test-only side effect)


def record(key: str) -> str:
    from testproject.demo.models import FireRecord

    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


@durable.workflow
def nap(ctx, naps):
    for _ in range(naps):
        ctx.sleep(timedelta(seconds=10))
    THREADS.append(threading.current_thread().name)
    return f"rested {naps}"


@durable.workflow
def nap_then_step(ctx):
    ctx.sleep(timedelta(seconds=10))
    return ctx.step(record, "after-nap")


@durable.workflow
def napping_child(ctx):
    ctx.sleep(timedelta(seconds=10))
    return "child rested"


@durable.workflow
def parent_of_napper(ctx):
    handle = ctx.start_child(napping_child)
    return ctx.wait_child(handle)


@pytest.fixture(autouse=True)
def _threads():
    THREADS.clear()


def test_a_sleep_that_ends_is_replayed_in_the_firing_batch(driver):
    run = nap.start(2)
    driver.settle(run, "completed", turns=40)
    assert WorkflowRun.objects.get(pk=run.pk).result == "rested 2"
    # The replays that slept again and the one that returned ran on the firing thread.
    assert THREADS and not any(name.startswith("durable") for name in THREADS)
    steps = list(WorkflowStep.objects.filter(run=run).order_by("seq").values("kind", "status"))
    assert steps == [{"kind": "sleep", "status": "done"}] * 2
    # Every wake-up timer of the run fired; none is left pending or claimed.
    states = set(Timer.objects.filter(target=run.pk).values_list("state", flat=True))
    assert states == {"fired"}
    assert WorkflowRun.objects.get(pk=run.pk).finished_at is not None


def test_a_replay_that_reaches_a_step_goes_to_the_executor_with_its_history(driver):
    run = nap_then_step.start()
    driver.settle(run, "completed", turns=40)
    assert records("after-nap") == ["after-nap"]
    # Start and sleep end: each wake-up was read once, by the batch, and handed over to the
    # executor's replay, which did not read the run again (one replay counted per wake-up).
    assert WorkflowRun.objects.get(pk=run.pk).replays == 2


def test_a_child_ending_inline_wakes_its_parent(driver):
    run = parent_of_napper.start()
    assert driver.settle(run, "completed", turns=40).result == "child rested"


def test_a_failed_inline_write_redoes_the_batch_the_usual_way(driver, monkeypatch):
    run = nap.start(1)
    driver.until(lambda: driver.state(run) == "sleeping")
    real = wakeups.write_ends
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("disk full")

    monkeypatch.setattr(wakeups, "write_ends", broken)
    driver.settle(run, "completed", turns=40)
    monkeypatch.setattr(wakeups, "write_ends", real)
    assert calls  # the inline write was tried, failed, and the batch was redone
    assert WorkflowRun.objects.get(pk=run.pk).result == "rested 1"
    assert any(name.startswith("durable") for name in THREADS)  # replayed on the executor


def test_an_executor_replay_marks_its_wake_up_fired_in_its_last_statement(driver):
    run = nap_then_step.start()
    driver.settle(run, "completed", turns=40)
    lease_tokens = dict(ShardLease.objects.values_list("shard", "token"))
    timers = list(Timer.objects.filter(target=run.pk).values("state", "fired_token", "shard"))
    assert len(timers) == 2  # start, end of the sleep
    assert all(t["state"] == "fired" for t in timers)
    assert all(t["fired_token"] == lease_tokens[t["shard"]] for t in timers)


def test_complete_claim_only_while_the_claim_stands():
    db_alias = "default"
    timer = Timer.objects.create(
        shard=0, bucket=0, fire_at_ms=1, state="firing", kind="workflow", target="r",
        attempts=2, claim_expires_ms=10,
    )  # fmt: skip
    assert not firing.complete_claim(db_alias, timer.pk, 1, 0, 7, 5)  # an older attempt
    assert Timer.objects.get(pk=timer.pk).state == "firing"
    assert firing.complete_claim(db_alias, timer.pk, 2, 0, 7, 5)
    done = Timer.objects.get(pk=timer.pk)
    assert (done.state, done.fired_token, done.claim_expires_ms) == ("fired", 7, None)
    assert not firing.complete_claim(db_alias, timer.pk, 2, 0, 7, 5)  # already fired


@pytest.mark.postgres
def test_a_run_locked_elsewhere_is_left_to_the_executor(driver):
    run = nap.start(1)
    driver.until(lambda: driver.state(run) == "sleeping")
    locked, release = threading.Event(), threading.Event()

    def hold_the_row():  # a cancel or a signal in flight in another connection
        from django.db import connection, transaction

        with transaction.atomic():
            list(WorkflowRun.objects.select_for_update().filter(pk=run.pk))
            locked.set()
            release.wait(10)
        connection.close()

    holder = threading.Thread(target=hold_the_row)
    holder.start()
    assert locked.wait(10)
    THREADS.clear()
    driver.clock.advance(timedelta(seconds=11))
    driver.engine.tick()  # the batch skips the locked run instead of waiting for it
    release.set()
    holder.join(10)
    driver.idle()
    driver.settle(run, "completed", turns=10)
    assert THREADS and all(name.startswith("durable") for name in THREADS)


@durable.workflow
def step_then_nap(ctx):
    ctx.step(record, "before-nap")
    ctx.sleep(timedelta(seconds=10))
    return "rested"


@pytest.mark.postgres
def test_the_checkpoint_that_suspends_marks_the_wake_up_last_and_commits_synchronously(
    driver, monkeypatch
):
    from django.db import connection

    from durable.storage import checkpoints

    settings_seen: list[str] = []
    real = firing.complete_claim

    def watched(*args, **kwargs):
        done = real(*args, **kwargs)
        with connection.cursor() as cursor:  # what the checkpoint will commit with
            cursor.execute("SELECT current_setting('synchronous_commit')")
            settings_seen.append(cursor.fetchone()[0])
        return done

    flushed_after: list[str] = []
    real_commit_steps = checkpoints.commit_steps

    def commit_steps(*args, **kwargs):
        if settings_seen:
            flushed_after.append("flush")
        return real_commit_steps(*args, **kwargs)

    monkeypatch.setattr(firing, "complete_claim", watched)
    monkeypatch.setattr(checkpoints, "commit_steps", commit_steps)
    run = step_then_nap.start()
    driver.settle(run, "sleeping", turns=10)
    start = Timer.objects.get(key=f"wf:{run.pk}:start")
    assert start.state == "fired"
    assert settings_seen and settings_seen[0] == "on" and not flushed_after
    assert driver.settle(run, "completed", turns=20).result == "rested"


@pytest.mark.postgres
def test_a_handed_over_run_is_marked_running_with_its_timer_claimed_in_one_statement(driver):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run = step_then_nap.start()  # its first call is a step: the start goes to the executor
    with CaptureQueriesContext(connection) as queries:
        driver.turn()
    sql = [q["sql"] for q in queries.captured_queries]
    merged = [s for s in sql if "UPDATE durable_workflowrun" in s and "claimed AS (UPDATE" in s]
    claims = [s for s in sql if "SET state = 'firing'" in s or "claim_expires_ms = " in s]
    assert len(merged) == 1 and claims == merged, "the firer did not claim it again"
    assert driver.settle(run, "completed", turns=20).result == "rested"
    start = Timer.objects.get(key=f"wf:{run.pk}:start")
    assert (start.state, start.attempts) == ("fired", 1)  # claimed once: one attempt


def test_only_a_runs_lone_timer_is_claimed_with_it():
    from types import SimpleNamespace as T

    from durable.workflows.inline import _lone_timers

    timers = [T(id=1, target="a"), T(id=2, target="b"), T(id=3, target="b"), T(id=4, target="c")]
    # b has two timers in the batch (one may have been left for the next batch): the
    # firer claims those; c was not handed over.
    assert _lone_timers(timers, ["a", "b"]) == [1]
