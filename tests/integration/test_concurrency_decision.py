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
from durable.models import Timer
from durable.storage import concurrency
from tests.integration import concurrency_support as support

pytestmark = [pytest.mark.django_db(transaction=True)]


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
