"""What a keyed batch's decision costs before its handlers start, and what it still sees.

On PostgreSQL the decision is two statements in one round trip (the keys locked, then
counted: :func:`durable.storage.key_rows.lock_and_count`) and the rate logs are
written by :func:`~durable.storage.concurrency.settle`, after the handlers started. The
count must still see every commit made before the lock was granted.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

import durable
from durable.core.ratelimit import parse_rate
from durable.limits import ConcurrencyKey
from durable.models import Timer, WorkflowRun
from durable.storage import concurrency
from tests.integration import concurrency_support as support

pytestmark = [pytest.mark.django_db(transaction=True)]


@durable.workflow(concurrency_key="decided", max_concurrency=1)
def decided(ctx):
    """Never replayed here: its runs' start timers are what the decisions are about."""


def recent(timer: Timer) -> list[int]:
    return ConcurrencyKey.objects.get(name=timer.concurrency_key).recent


def test_a_decision_is_one_round_trip_and_writes_nothing_before_the_handlers(clock):
    timers = [durable.schedule(support.rated, args=[f"k{n % 4}", n]) for n in range(8)]
    now, rate = clock.now_ms(), parse_rate("100/s")
    limits = {timer.pk: (None, rate) for timer in timers}
    with transaction.atomic():  # the keys' rows are created by their first decision
        assert concurrency.admit("default", limits, now, 16) == set()
    with transaction.atomic():
        logs = concurrency.Logs()
        with CaptureQueriesContext(connection) as decided:
            assert concurrency.admit("default", limits, now + 1, 16, {}, logs) == set()
        assert [recent(timer) for timer in timers[:4]] == [[now, now]] * 4, "not written yet"
        with CaptureQueriesContext(connection) as settled:
            concurrency.settle("default", [], [], now + 1, logs)
    statements = [query["sql"] for query in decided]
    assert not [sql for sql in statements if sql.lstrip().upper().startswith("UPDATE")]
    if connection.vendor == "postgresql":
        assert len(statements) == 2, statements  # the lock and the count, pipelined
        assert len(settled) == 1, "the four keys' logs in one statement"
    assert [recent(timer) for timer in timers[:4]] == [[now, now, now + 1, now + 1]] * 4


def test_kept_logs_take_back_a_start_the_batch_left_for_later(clock):
    keyed = durable.schedule(support.rated, args=["k", 1])
    now, limits = clock.now_ms(), {keyed.pk: (None, parse_rate("1/m"))}
    with transaction.atomic():
        logs = concurrency.Logs()
        assert concurrency.admit("default", limits, now, 16, {}, logs) == set()
        concurrency.settle("default", [], [keyed.pk], now, logs)
    assert recent(keyed) == []
    assert Timer.objects.get(pk=keyed.pk).queued_ms == keyed.fire_at_ms, "its place in line"
    with transaction.atomic():
        logs = concurrency.Logs()
        assert concurrency.admit("default", limits, now + 10, 16, {}, logs) == set()
        concurrency.settle("default", [keyed.pk], [], now + 10, logs)
    assert recent(keyed) == [now + 10]
    assert Timer.objects.get(pk=keyed.pk).queued_ms is None, "started: it left the line"


def test_the_count_sees_the_commit_the_lock_waited_for(clock):
    # The slot's holder ends (and commits) while the decision waits for the key's lock:
    # counted in the lock's own statement (its snapshot taken before the wait), the
    # ended timer would still hold the slot and the new one would be parked, with no
    # end left to wake it.
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL; `make test` runs it against one")
    first, second = (durable.schedule(support.gated, args=["acme", n]) for n in (1, 2))
    name = first.concurrency_key
    ConcurrencyKey.objects.create(name=name, max_concurrency=1)
    Timer.objects.filter(pk__in=[first.pk, second.pk]).update(attempts=1)  # counted
    Timer.objects.filter(pk=first.pk).update(state="firing")
    locked = threading.Event()

    def end_the_first() -> None:
        try:
            with transaction.atomic():
                ConcurrencyKey.objects.select_for_update().get(name=name)
                Timer.objects.filter(pk=first.pk).update(state="fired")
                locked.set()
                time.sleep(0.5)  # the decision waits for this lock meanwhile
        finally:
            connections.close_all()

    ender = threading.Thread(target=end_the_first)
    ender.start()
    try:
        assert locked.wait(5)
        with transaction.atomic():
            logs = concurrency.Logs()
            parked = concurrency.admit("default", {second.pk: (1, None)}, 0, 16, {}, logs)
    finally:
        ender.join()
    assert parked == set(), "the slot the first timer freed is the second's"


def start_of(run: WorkflowRun) -> Timer:
    return Timer.objects.get(key=f"wf:{run.pk}:start")


def test_a_workflow_keys_decision_counts_its_runs_in_the_one_round_trip(clock):
    holder, second, third = decided.start(), decided.start(), decided.start()
    name = holder.concurrency_key
    ConcurrencyKey.objects.create(name=name, max_concurrency=2)
    WorkflowRun.objects.filter(pk=holder.pk).update(state="sleeping")  # holds a slot
    Timer.objects.filter(kind="workflow").update(attempts=1)  # counted, as a batch's are
    limits = {start_of(second).pk: (2, None)}
    with transaction.atomic(), CaptureQueriesContext(connection) as decided_in:
        assert concurrency.admit("default", limits, clock.now_ms(), 16) == set()
    if connection.vendor == "postgresql":
        assert len(decided_in) == 2, [q["sql"] for q in decided_in]  # lock and count, pipelined
    WorkflowRun.objects.filter(pk=second.pk).update(state="running")
    with transaction.atomic():
        limits = {start_of(third).pk: (2, None)}
        parked = concurrency.admit("default", limits, clock.now_ms(), 16)
    assert parked == {start_of(third).pk}, "the two runs hold both slots"


def test_a_workflow_keys_count_sees_the_run_end_the_lock_waited_for(clock):
    # As above for a handler's key: the run that held the slot ends (and commits) while
    # the decision waits for the key's lock; the one count must see it ended.
    if connection.vendor != "postgresql":
        pytest.skip("needs PostgreSQL; `make test` runs it against one")
    holder, second = decided.start(), decided.start()
    name = holder.concurrency_key
    ConcurrencyKey.objects.create(name=name, max_concurrency=1)
    WorkflowRun.objects.filter(pk=holder.pk).update(state="waiting")
    locked = threading.Event()

    def end_the_holder() -> None:
        try:
            with transaction.atomic():
                ConcurrencyKey.objects.select_for_update().get(name=name)
                WorkflowRun.objects.filter(pk=holder.pk).update(state="completed")
                locked.set()
                time.sleep(0.5)  # the decision waits for this lock meanwhile
        finally:
            connections.close_all()

    ender = threading.Thread(target=end_the_holder)
    ender.start()
    try:
        assert locked.wait(5)
        with transaction.atomic():
            limits = {start_of(second).pk: (1, None)}
            parked = concurrency.admit("default", limits, 0, 16, {}, concurrency.Logs())
    finally:
        ender.join()
    assert parked == set(), "the slot the ended run freed is the second's"
