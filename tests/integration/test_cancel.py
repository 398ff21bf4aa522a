"""durable.cancel(): conditional, cascading to children, with on_complete follow-ups."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections, transaction
from django.test.utils import override_settings

import durable
from durable.conf import get_settings
from durable.exceptions import TimerError
from durable.models import Timer
from durable.storage.timers import create_followup
from durable.testing import ManualClock, override_clock
from testproject.demo import handlers as h

NOW = 1_700_000_000_000
pytestmark = pytest.mark.django_db


@durable.handler(max_attempts=3, backoff=timedelta(seconds=10))
def tuned_followup(timer_id: int, context: Any, result: dict[str, Any]) -> None:
    """An ``on_complete`` handler with its own retry policy."""


@pytest.fixture
def clock():
    with override_clock(ManualClock(start_ms=NOW)) as manual:
        yield manual


def state(timer: Timer) -> str:
    return Timer.objects.get(pk=timer.pk).state


def test_cancel_a_pending_timer(clock):
    timer = durable.schedule(h.noop)
    other = durable.schedule(h.noop)
    assert durable.cancel(timer) is True
    assert state(timer) == "canceled"
    assert state(other) == "pending"
    assert durable.cancel(timer.pk) is False  # already cancelled: not this call's doing


def test_cancel_unknown_id_is_false():
    assert durable.cancel(10**9) is False


@pytest.mark.parametrize("done", ["fired", "failed", "firing", "canceled"])
def test_cancel_is_false_and_harmless_once_a_timer_left_pending(clock, done):
    timer = durable.schedule(h.noop)
    child = durable.schedule(h.noop, parent=timer)
    Timer.objects.filter(pk=timer.pk).update(state=done)
    assert durable.cancel(timer) is False
    assert state(timer) == done
    assert state(child) == "pending"  # no cascade from a timer this call did not cancel


def test_cancel_refuses_what_is_not_a_timer():
    with pytest.raises(TimerError, match=r"^timer_or_id: this Timer is not saved"):
        durable.cancel(Timer())
    with pytest.raises(TypeError, match=r"^timer_or_id: expected a Timer or its id, got str"):
        durable.cancel("12")


def test_cancel_cascades_to_pending_descendants(clock):
    root = durable.schedule(h.noop)
    child = durable.schedule(h.noop, parent=root)
    grandchild = durable.schedule(h.noop, parent=child)
    fired_child = durable.schedule(h.noop, parent=root)
    its_child = durable.schedule(h.noop, parent=fired_child)
    Timer.objects.filter(pk=fired_child.pk).update(state="fired")
    stranger = durable.schedule(h.noop)
    assert durable.cancel(root) is True
    assert [state(t) for t in (root, child, grandchild, its_child)] == ["canceled"] * 4
    assert state(fired_child) == "fired"
    assert state(stranger) == "pending"


def test_cancelling_a_child_leaves_parent_and_siblings(clock):
    root = durable.schedule(h.noop)
    child, sibling = (durable.schedule(h.noop, parent=root) for _ in range(2))
    assert durable.cancel(child) is True
    assert [state(t) for t in (root, child, sibling)] == ["pending", "canceled", "pending"]


def test_every_cancelled_timer_with_on_complete_gets_a_followup(clock):
    root = durable.schedule(h.noop, on_complete=h.on_done, context={"order": 1})
    child = durable.schedule(h.noop, parent=root, on_complete=tuned_followup, context=["c"])
    durable.schedule(h.noop, parent=root)  # no on_complete: no follow-up
    clock.advance(5_000)
    assert durable.cancel(root) is True
    followups = {t.key: t for t in Timer.objects.filter(key__startswith="on_complete:")}
    assert set(followups) == {f"on_complete:{root.pk}", f"on_complete:{child.pk}"}
    mine = followups[f"on_complete:{root.pk}"]
    assert mine.target == "testproject.demo.handlers.on_done"
    assert mine.kwargs == {
        "timer_id": root.pk,
        "context": {"order": 1},
        "result": {"status": "canceled"},
    }
    assert (mine.fire_at_ms, mine.shard, mine.state) == (NOW + 5_000, root.shard, "pending")
    assert mine.parent_id is None  # a later cancel of the tree must not cancel the report
    childs = followups[f"on_complete:{child.pk}"]
    assert childs.kwargs["context"] == ["c"] and childs.shard == child.shard
    assert (childs.max_attempts, childs.backoff_base_s) == (3, 10.0)  # the handler's policy


@pytest.mark.django_db(transaction=True)
def test_cancel_in_a_rolled_back_transaction_changes_nothing(clock):
    timer = durable.schedule(h.noop, on_complete=h.on_done)
    with transaction.atomic():
        assert durable.cancel(timer) is True
        transaction.set_rollback(True)
    assert state(timer) == "pending"
    assert Timer.objects.count() == 1  # no follow-up either


# -- create_followup, as the worker calls it ----------------------------------------------------


@dataclass(frozen=True)
class Done:
    """Shaped like the worker's row (not a model instance)."""

    id: int
    shard: int
    on_complete: str
    context: Any


def test_followup_is_idempotent_per_completed_timer(clock):
    timer = durable.schedule(h.noop, on_complete=h.on_done, context={"a": 1})
    result = {"status": "success", "value": [1, 2]}
    first = create_followup(timer, result, NOW + 7)
    again = create_followup(timer, {"status": "failed", "error": "late"}, NOW + 9)
    assert again.pk == first.pk and again.kwargs["result"] == result
    assert Timer.objects.filter(key=f"on_complete:{timer.pk}").count() == 1
    assert first.fire_at_ms == NOW + 7


def test_followup_accepts_the_workers_row_and_skips_timers_without_on_complete(clock):
    done = Done(id=41, shard=3, on_complete="testproject.demo.handlers.on_done", context=None)
    followup = create_followup(done, {"status": "failed", "error": "boom"}, NOW)
    assert followup.shard == 3
    assert followup.kwargs == {
        "timer_id": 41,
        "context": None,
        "result": {"status": "failed", "error": "boom"},
    }
    assert create_followup(Done(id=42, shard=3, on_complete="", context=None), {}, NOW) is None


def test_followup_of_a_vanished_handler_still_records_the_completion(clock):
    done = Done(id=43, shard=0, on_complete="testproject.demo.handlers.renamed", context=None)
    with override_settings(DURABLE={"MAX_ATTEMPTS": 4}):
        followup = create_followup(done, {"status": "success", "value": None}, NOW)
    assert followup.target == "testproject.demo.handlers.renamed"
    assert followup.max_attempts == 4
    assert followup.backoff_max_s == get_settings().BACKOFF_MAX_S


# -- racing the worker on PostgreSQL ----------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("worker_fires", [True, False])
def test_cancel_waits_for_a_firing_worker_and_respects_its_outcome(clock, worker_fires):
    timer = durable.schedule(h.noop)
    locked, release = threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    def worker():
        # What the firer does: lock the pending row, run the handler, mark it fired.
        with transaction.atomic():
            list(Timer.objects.select_for_update().filter(pk=timer.pk, state="pending"))
            locked.set()
            release.wait(10)
            if worker_fires:
                Timer.objects.filter(pk=timer.pk).update(state="fired")

    def canceller():
        results["cancel"] = durable.cancel(timer.pk)

    threads = [
        threading.Thread(target=_closing(worker)),
        threading.Thread(target=_closing(canceller)),
    ]
    threads[0].start()
    assert locked.wait(10)
    threads[1].start()
    _wait_for_lock_waiter()
    release.set()
    for thread in threads:
        thread.join(10)
    assert results["cancel"] is (not worker_fires)
    assert state(timer) == ("fired" if worker_fires else "canceled")


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
    raise AssertionError("cancel() never waited on the worker's row lock")
