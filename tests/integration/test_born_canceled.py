"""Born cancelled: a timer scheduled under a cancelled parent is created cancelled.

Sequentially on SQLite and PostgreSQL; the race with a concurrent ``cancel()`` on
PostgreSQL, with two connections, each side committing first in turn.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections, transaction

import durable
from durable.models import Timer, WorkflowRun
from testproject.demo import handlers as h
from tests.integration import workflow_support as support

pytestmark = pytest.mark.django_db
driver = support.driver  # fixture (clock: tests/integration/conftest.py)


def state(timer: Timer) -> str:
    return Timer.objects.get(pk=timer.pk).state


def followups(timer: Timer) -> list[Timer]:
    return list(Timer.objects.filter(key=f"on_complete:{timer.pk}"))


def test_a_child_of_a_cancelled_parent_is_born_cancelled_and_never_fires(start_engine, clock):
    engine = start_engine({"SHARDS": 1})
    parent = durable.schedule(h.record, args=["parent"])
    assert durable.cancel(parent) is True
    child = durable.schedule(h.record, args=["child"], parent=parent, on_complete=h.on_done)
    assert child.state == "canceled" and state(child) == "canceled"
    [followup] = followups(child)
    assert followup.kwargs["result"] == {"status": "canceled"}
    grandchild = durable.schedule(h.record, args=["grandchild"], parent=child)
    assert state(grandchild) == "canceled"  # a born-cancelled parent is a cancelled parent
    for _ in range(3):
        clock.advance(1_000)
        engine.tick()
    assert state(child) == "canceled" and state(grandchild) == "canceled"
    assert state(followup) == "fired"  # the follow-up itself is an ordinary timer


def test_schedule_many_cancels_only_the_children_of_cancelled_parents(clock):
    cancelled, pending = durable.schedule(h.noop), durable.schedule(h.noop)
    durable.cancel(cancelled)
    rows = durable.schedule_many(
        [
            {"fn": h.noop, "parent": cancelled},
            {"fn": h.noop, "parent": pending},
            {"fn": h.noop},
            {"fn": h.noop, "parent": cancelled.pk, "on_complete": h.on_done},
        ]
    )
    assert [state(t) for t in rows] == ["canceled", "pending", "pending", "canceled"]
    assert [len(followups(t)) for t in rows] == [0, 0, 0, 1]


@pytest.mark.parametrize("finished", ["fired", "failed"])
def test_a_finished_parent_still_takes_pending_children(clock, finished):
    parent = durable.schedule(h.noop)
    Timer.objects.filter(pk=parent.pk).update(state=finished)
    child = durable.schedule(h.noop, parent=parent)
    [many] = durable.schedule_many([{"fn": h.noop, "parent": parent}])
    assert state(child) == "pending" and state(many) == "pending"


def test_an_existing_key_is_returned_unchanged_under_a_cancelled_parent(clock):
    first = durable.schedule(h.noop, key="k:1")
    parent = durable.schedule(h.noop)
    durable.cancel(parent)
    again = durable.schedule(h.noop, key="k:1", parent=parent, on_complete=h.on_done)
    [many] = durable.schedule_many([{"fn": h.noop, "key": "k:1", "parent": parent}])
    assert again.pk == first.pk == many.pk and state(first) == "pending"
    assert Timer.objects.filter(key__startswith="on_complete:").count() == 0


# -- racing cancel() on PostgreSQL -------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["schedule", "cancel"])
def test_a_concurrent_cancel_never_leaves_a_pending_child(clock, first):
    """Whichever transaction takes the parent's row first, the child ends cancelled."""
    parent = durable.schedule(h.noop)
    holding, release = threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def scheduler() -> None:
        with transaction.atomic():
            results["child"] = durable.schedule(h.noop, parent=parent)
            if first == "schedule":
                holding.set()
                release.wait(10)

    def canceller() -> None:
        with transaction.atomic():
            results["cancel"] = durable.cancel(parent)
            if first == "cancel":
                holding.set()
                release.wait(10)

    one, two = (scheduler, canceller) if first == "schedule" else (canceller, scheduler)
    threads = [threading.Thread(target=_closing(one)), threading.Thread(target=_closing(two))]
    threads[0].start()
    assert holding.wait(10)
    threads[1].start()
    _wait_for_lock_waiter()  # the second waits on the first's lock of the parent's row
    release.set()
    for thread in threads:
        thread.join(10)
    assert results["cancel"] is True
    assert state(parent) == "canceled"
    assert state(results["child"]) == "canceled"


def _closing(fn):
    def run():
        try:
            fn()
        finally:
            connections.close_all()

    return run


def _wait_for_lock_waiter() -> None:
    with connections["default"].cursor() as cursor:
        for _ in range(1000):
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0]:
                return
            threading.Event().wait(0.01)
    raise AssertionError("the second transaction never waited on the parent's row lock")


# -- workflows: a cancelled run never gets a child ----------------------------------------


def _cancel_run(run_id: str) -> str:
    durable.cancel_workflow(run_id)
    return "cancelled"


@durable.workflow
def _born_child(ctx):
    return "ran"


@durable.workflow
def _cancels_then_spawns(ctx):
    ctx.step(_cancel_run, ctx.run_id)  # cancelled while its replay is running
    return ctx.child(_born_child)


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_run_starts_no_child(driver):
    run = driver.settle(_cancels_then_spawns.start(), "canceled")
    assert not WorkflowRun.objects.filter(parent=run).exists()
    assert WorkflowRun.objects.count() == 1


def test_a_failed_child_of_a_cancelled_parent_cannot_be_retried(clock):
    from datetime import timedelta

    from durable.exceptions import TimerError
    from durable.scheduling.operations import retry

    parent = durable.schedule(h.record, args=["parent"], delay=timedelta(hours=1))
    child = durable.schedule(h.record, args=["child"], parent=parent)
    Timer.objects.filter(pk=child.pk).update(state="failed", last_error="RuntimeError: boom")
    assert durable.cancel(parent) is True
    with pytest.raises(TimerError, match=rf"its parent {parent.pk} is cancelled"):
        retry(child)
    assert state(child) == "failed"  # untouched: nothing pending under a cancelled parent
    assert not Timer.objects.filter(parent_id=parent.pk, state="pending").exists()
