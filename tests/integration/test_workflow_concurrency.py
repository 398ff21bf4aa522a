"""Concurrency keys on workflows, turn by turn: a run holds its key's slot from its first
replay to its end, sleeps and waits included; over the limit it stays pending in line.

Every way out frees the slot (completed, failed, cancelled, its wake-up dead-lettered), a
cancelled waiting run leaves the line, a retried run takes a slot again, children obey
their own workflow's limit. The two-worker proof (1,000 runs, a kill mid-way) is
``tests/acceptance/test_workflow_concurrency_cluster.py``.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import connections, transaction

import durable
from durable.conf import get_settings
from durable.core.sharding import shard_for
from durable.dispatch.concurrency import ConcurrencyKeyError
from durable.models import Timer, WorkflowRun
from durable.storage.concurrency import PARKED_MS
from durable.workflows import retry
from durable.workflows.resume import fail_run
from testproject.demo.models import FireRecord
from tests.integration import workflow_support as support

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)


def record(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


def flaky(n: int) -> int:
    """Fails while a ``break:<n>`` record exists."""
    if FireRecord.objects.filter(key=f"break:{n}").exists():
        raise ValueError(f"{n} is broken")
    return n


def by_account(account: str, n: int) -> str:
    if n == 0:
        raise LookupError("no account")
    return account


@durable.workflow(concurrency_key=by_account, max_concurrency=2, max_attempts=1)
def gated(ctx, account, n):
    """Enters, waits for signal ``go``, runs ``flaky``, leaves."""
    ctx.atomic(record, f"enter:{n}")
    ctx.wait_for_signal("go")
    ctx.step(flaky, n)
    ctx.atomic(record, f"leave:{n}")
    return n


@durable.workflow(concurrency_key="feed", rate_limit="2/m")
def rated(ctx, n):
    ctx.atomic(record, f"rated:{n}")


@durable.workflow(concurrency_key="nap", max_concurrency=1)
def napper(ctx, n):
    """Enters, then sleeps: the wake-up's replay ends the run inside the firing batch."""
    ctx.atomic(record, f"enter:{n}")
    ctx.sleep(timedelta(seconds=5))
    return n


@durable.workflow
def parent(ctx, count):
    children = [ctx.start_child(gated, "kids", n) for n in range(1, count + 1)]
    return [ctx.wait_child(child) for child in children]


def entered() -> list[int]:
    """The ``n`` of every run that entered, in the order they did."""
    rows = FireRecord.objects.filter(key__startswith="enter:").order_by("id")
    return [int(key.split(":")[1]) for key in rows.values_list("key", flat=True)]


def start_line(driver, count, account="acme"):
    """``count`` runs of ``account``, started 10 ms apart: 1 and 2 enter, the rest wait."""
    runs = []
    for n in range(1, count + 1):
        runs.append(gated.start(account, n))
        driver.clock.advance(10)
    driver.until(lambda: len(entered()) >= 2)
    driver.turn()
    driver.turn()
    assert sorted(entered()) == [1, 2], "admitted together: their replays race to enter"
    return runs


def start_timer(run):
    return Timer.objects.get(key=f"wf:{run.pk}:start")


def holding(key="workflow:" + gated.name + ":acme") -> int:
    return WorkflowRun.objects.filter(
        concurrency_key=key, state__in=("running", "sleeping", "waiting")
    ).count()


def go(driver, run, state="completed"):
    durable.send_signal(run, "go")
    return driver.settle(run, state)


def test_a_start_stores_the_key_and_lives_on_the_keys_shard(clock):
    run = gated.start("acme", 1)
    key = f"workflow:{gated.name}:acme"
    assert run.concurrency_key == key
    assert run.shard == shard_for(key, get_settings().SHARDS)
    timer = start_timer(run)
    assert (timer.concurrency_key, timer.shard) == (key, run.shard)
    (many,) = gated.start_many([{"args": ["zeta", 2]}])
    assert many.concurrency_key == f"workflow:{gated.name}:zeta"
    assert start_timer(many).concurrency_key == many.concurrency_key


def test_over_the_limit_a_run_stays_pending_in_line_and_enters_in_arrival_order(driver):
    runs = start_line(driver, 5)
    assert [driver.state(r) for r in runs] == ["waiting"] * 2 + ["pending"] * 3
    for n, run in enumerate(runs[2:], start=3):
        parked = start_timer(run)
        assert parked.fire_at_ms == PARKED_MS, "it waits as a timer: no polling"
        assert parked.queued_ms == support.START_MS + 10 * (n - 1), "its place: its start"
    other = gated.start("zeta", 9)  # another key is not held back
    driver.settle(other, "waiting")
    for done, woken in ((1, 3), (2, 4), (3, 5)):
        go(driver, runs[done - 1])
        driver.until(lambda woken=woken: woken in entered())
        assert holding() <= 2
    assert entered()[2:] == [9, 3, 4, 5]
    for run in runs[3:]:
        go(driver, run)
    assert holding() == 0


def test_a_run_holds_its_slot_across_its_sleeps_and_waits(driver):
    runs = start_line(driver, 3)
    for _ in range(5):
        driver.turn()  # the first two wait for their signal: 3 stays in line
    assert sorted(entered()) == [1, 2]
    assert driver.state(runs[2]) == "pending"


def test_a_failed_run_frees_its_slot_and_its_retry_takes_one_again(driver):
    runs = start_line(driver, 4)
    record("break:1")
    go(driver, runs[0], "failed")
    driver.until(lambda: 3 in entered())
    FireRecord.objects.filter(key="break:1").delete()
    retry(runs[0])  # 2 and 3 hold the slots: the retry waits behind 4, in line
    (again,) = Timer.objects.filter(key__startswith=f"wf:{runs[0].pk}:retry")
    assert again.concurrency_key == runs[0].concurrency_key
    for _ in range(3):
        driver.turn()
    assert driver.state(runs[0]) == "pending"
    assert Timer.objects.get(pk=again.pk).fire_at_ms == PARKED_MS
    go(driver, runs[1])  # 4 came first
    driver.until(lambda: 4 in entered())
    assert driver.state(runs[0]) == "pending"
    go(driver, runs[2])
    driver.settle(runs[0], "completed")
    assert holding() == 1


def test_cancelling_a_waiting_run_takes_it_out_and_a_running_one_frees_its_slot(driver):
    runs = start_line(driver, 4)
    assert durable.cancel_workflow(runs[2])  # in line: it just leaves it
    assert start_timer(runs[2]).state == "canceled"
    assert durable.cancel_workflow(runs[0])  # waiting for its signal: its slot frees
    driver.until(lambda: 4 in entered())
    for _ in range(3):
        driver.turn()
    assert entered()[2:] == [4]
    assert driver.state(runs[2]) == "canceled"
    assert holding() == 2


def test_a_run_whose_wake_up_is_dead_lettered_frees_its_slot(driver):
    runs = start_line(driver, 3)
    wake = SimpleNamespace(id=0, target=runs[0].pk)
    with transaction.atomic():  # what the dead letter of its wake-up timer does
        fail_run("default", wake, "boom", driver.clock.now_ms())
    assert driver.state(runs[0]) == "failed"
    driver.until(lambda: 3 in entered())


def test_children_obey_their_workflows_limit(driver):
    run = parent.start(3)
    driver.until(lambda: len(entered()) >= 2)
    for _ in range(3):
        driver.turn()
    assert sorted(entered()) == [1, 2]
    kids = list(WorkflowRun.objects.filter(parent_id=run.pk).order_by("created_at", "id"))
    assert {kid.concurrency_key for kid in kids} == {f"workflow:{gated.name}:kids"}
    waiting = [kid for kid in kids if driver.state(kid) == "waiting"]
    for kid in waiting:
        go(driver, kid)
    driver.until(lambda: len(entered()) == 3)
    (last,) = [kid for kid in kids if kid not in waiting]
    go(driver, last)
    assert driver.settle(run, "completed").result == [1, 2, 3]


def test_a_key_callable_that_fails_makes_start_raise_and_writes_nothing(clock):
    with pytest.raises(ConcurrencyKeyError, match=r"concurrency_key of workflow .* returned"):
        gated.start(7, 1)  # the key callable returns an int
    with pytest.raises(ConcurrencyKeyError, match="raised LookupError: no account"):
        gated.start("acme", 0)
    assert not WorkflowRun.objects.exists() and not Timer.objects.exists()


def test_a_rate_limit_counts_run_starts(driver):
    runs = [rated.start(n) for n in (1, 2, 3)]
    start_ms = driver.clock.now_ms()
    driver.until(lambda: len(support.records("rated:")) == 2)
    for _ in range(3):
        driver.turn()
    assert support.records("rated:") == ["rated:1", "rated:2"]
    assert driver.state(runs[2]) == "pending"
    third = start_timer(runs[2])
    # Due when the minute's window has room: a minute after the first two were admitted.
    assert start_ms + 60_000 <= third.fire_at_ms <= start_ms + 61_000
    driver.until(lambda: driver.state(runs[2]) == "completed", turns=70)
    assert driver.clock.now_ms() >= start_ms + 60_000


def test_cancelling_a_parent_frees_its_childrens_slots(driver):
    run = parent.start(3)
    driver.until(lambda: len(entered()) >= 2)
    kids_key = f"workflow:{gated.name}:kids"
    assert holding(kids_key) == 2
    other = gated.start("kids", 4)  # not of the tree: waits behind the third child
    for _ in range(3):
        driver.turn()
    assert start_timer(other).fire_at_ms == PARKED_MS
    assert durable.cancel_workflow(run)
    kids = WorkflowRun.objects.filter(parent_id=run.pk)
    assert set(kids.values_list("state", flat=True)) == {"canceled"}
    assert start_timer(other).fire_at_ms == driver.clock.now_ms(), "woken by the cancel"
    driver.settle(other, "waiting")
    assert entered()[2:] == [4]


def test_a_run_that_ends_inside_the_firing_batch_frees_its_slot(driver):
    first, second = napper.start(1), napper.start(2)
    driver.settle(first, "sleeping")
    assert driver.state(second) == "pending" and entered() == [1]
    driver.settle(first, "completed")
    assert FireRecord.objects.filter(key="enter:1").count() == 1
    driver.settle(second, "sleeping", "completed")
    assert entered() == [1, 2]


@pytest.mark.postgres
def test_a_start_committed_late_takes_its_place_by_when_it_started(driver):
    # Run 3 is started first but its transaction commits after 4 and 5 joined the line:
    # the line goes by when runs were started, not by when they became visible.
    start_line(driver, 2, account="late")
    begun, commit = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow_start() -> None:
        try:
            with transaction.atomic():
                gated.start("late", 3)
                begun.set()
                commit.wait(10)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=slow_start)
    thread.start()
    assert begun.wait(10)
    driver.clock.advance(10)
    later = [gated.start("late", 4), gated.start("late", 5)]
    for _ in range(3):
        driver.turn()
    assert all(start_timer(run).fire_at_ms == PARKED_MS for run in later)
    commit.set()
    thread.join()
    assert not errors, errors
    (third,) = WorkflowRun.objects.filter(args=["late", 3])
    driver.until(lambda: start_timer(third).fire_at_ms == PARKED_MS)
    assert start_timer(third).queued_ms < start_timer(later[0]).queued_ms
    first = WorkflowRun.objects.get(args=["late", 1])
    go(driver, first)
    driver.until(lambda: 3 in entered())
    for _ in range(3):
        driver.turn()
    assert entered()[2:] == [3], "3 went first, 4 and 5 still wait"
