"""Debounce on PostgreSQL: two writers with their own connections and transactions.

Each test makes the second writer wait on the first one's lock (a row lock or the key's
unique index entry), checked in ``pg_stat_activity``, then lets the first commit or roll
back. Whatever the order, the key ends with exactly one pending timer, carrying the last
committed call's arguments; no call is lost and no second timer appears.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest
from django.db import connection, connections, transaction

import durable
from durable.models import Timer
from durable.storage.notify import CHANNEL
from durable.testing import ManualClock, override_clock
from testproject.demo import handlers as h

NOW = 1_700_000_000_000
S = 1_000
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def clock():
    with override_clock(ManualClock(start_ms=NOW)) as manual:
        yield manual


def debounced(label: str) -> Timer:
    return durable.schedule(
        h.record, args=[label], key="race", debounce=timedelta(seconds=5), max_wait=timedelta(1)
    )


def in_thread(fn, results: dict, name: str) -> threading.Thread:
    def run():
        try:
            results[name] = fn()
        except BaseException as exc:  # reported by the test, not lost in the thread
            results[name] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread


def wait_for_lock_waiter(timeout_s: float = 10.0) -> None:
    """Block until some backend of the test database waits on a lock."""
    with connections["default"].cursor() as cursor:
        for _ in range(int(timeout_s * 100)):
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0]:
                return
            threading.Event().wait(0.01)
    raise AssertionError("the second writer never waited on the first one")


def race(first_commits: bool) -> dict:
    """Writer "first" debounces and holds its transaction open until "second" waits on
    it; then it commits (or rolls back) and "second" goes on. Returns their results."""
    release, written = threading.Event(), threading.Event()
    results: dict = {}

    def first():
        with transaction.atomic():
            timer = debounced("first")
            written.set()
            assert release.wait(10)
            if not first_commits:
                transaction.set_rollback(True)
            return timer.pk

    def second():
        with transaction.atomic():
            return debounced("second").pk

    one = in_thread(first, results, "first")
    assert written.wait(10)
    two = in_thread(second, results, "second")
    wait_for_lock_waiter()
    release.set()
    one.join(10)
    two.join(10)
    for name in ("first", "second"):
        assert not isinstance(results[name], BaseException), results[name]
    return results


def only_pending() -> Timer:
    pending = list(Timer.objects.filter(state="pending"))
    assert len(pending) == 1, pending
    assert pending[0].key == "race"
    return pending[0]


@pytest.mark.parametrize("first_commits", [True, False])
def test_two_writers_with_no_timer_yet_end_with_one(clock, first_commits):
    results = race(first_commits)  # the second waits on the key's unique index entry
    row = only_pending()
    assert results["second"] == row.pk and row.args == ["second"]
    assert Timer.objects.count() == 1


@pytest.mark.parametrize("first_commits", [True, False])
def test_two_writers_moving_one_timer_end_with_one(clock, first_commits):
    original = debounced("original")
    clock.advance(S)
    results = race(first_commits)  # the second waits on the row the first one moved
    row = only_pending()
    assert results["second"] == row.pk and row.args == ["second"]
    assert (row.fire_at_ms, row.debounce_since_ms) == (NOW + 6 * S, NOW)
    assert Timer.objects.count() == 1
    assert Timer.objects.filter(pk=original.pk).exists() is False


def test_two_writers_after_the_timer_fired_start_one_new_burst(clock):
    fired = debounced("original")
    Timer.objects.filter(pk=fired.pk).update(state="fired")
    clock.advance(10 * S)
    race(first_commits=True)  # the second waits on the fired row the first released
    row = only_pending()
    assert row.args == ["second"] and row.debounce_since_ms == NOW + 10 * S
    assert Timer.objects.get(pk=fired.pk).key is None
    assert Timer.objects.count() == 2


def test_many_writers_in_a_burst_leave_one_pending_timer(clock):
    results: dict = {}
    start = threading.Barrier(4)

    def writer(name: str):
        start.wait(10)
        for call in range(15):
            with transaction.atomic():
                debounced(f"{name}:{call}")
        return True

    threads = [in_thread(lambda n=n: writer(n), results, n) for n in ("a", "b", "c", "d")]
    for thread in threads:
        thread.join(60)
    assert all(value is True for value in results.values()), results
    row = only_pending()
    assert row.args[0].endswith(":14")  # one writer's last call was the last to commit
    assert Timer.objects.count() == 1


def test_the_moved_timer_is_announced_at_commit(clock):
    params = connection.get_connection_params()
    listener = psycopg.connect(
        host=params.get("host"),
        port=params.get("port"),
        user=params.get("user"),
        password=params.get("password"),
        dbname=params.get("dbname"),
        autocommit=True,
    )
    try:
        listener.execute(f"LISTEN {CHANNEL}")
        debounced("a")
        clock.advance(S)
        moved = debounced("b")
        payloads = [n.payload for n in listener.notifies(timeout=10, stop_after=2)]
    finally:
        listener.close()
    assert payloads[-1] == f"{moved.shard},{moved.pk},{NOW + 6 * S}"
