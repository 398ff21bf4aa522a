"""The next batch's attempts are counted while the current batch fires (issue 16).

``durable.worker.ahead.CountAhead`` runs the count of the batch the engine fires next on
a thread and connection of its own. What must hold: each batch's count still commits
before any of its handlers runs, under its shards' tokens; a count whose batch does not
run as counted is given back (the row as if never counted); and a drain fires
everything once, one attempt each.
"""

from __future__ import annotations

import threading

import pytest
from django.db import transaction

import durable
from durable.models import Timer
from durable.worker import counting
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.integration.sharding_support import keys_in_shards, make_due

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SHARDS = 4


@pytest.fixture
def engine(start_engine):
    return start_engine({"SHARDS": SHARDS, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0})


def _due_work(engine, clock, per_shard: int = 3):
    """Schedule ``per_shard`` timers in two shards, make them due: one work item each."""
    keys = keys_in_shards("ahead", 2, per_shard, SHARDS)
    now = make_due(engine, clock, keys[0] + keys[1])
    first, second = (engine.runners[s] for s in (0, 1))
    return [(first, first.due(now))], [(second, second.due(now))]


def _rows(work):
    ids = [i for _, chunk in work for i in chunk]
    return {t.id: (t.state, t.attempts, t.claim_token) for t in Timer.objects.filter(id__in=ids)}


@pytest.fixture
def count_threads(monkeypatch):
    """The name of the thread each count ran on, in order."""
    names: list[str] = []
    real = counting.count

    def count(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(counting, "count", count)
    return names


def test_the_next_batch_is_counted_on_its_own_thread_and_fires_once(engine, clock, count_threads):
    first, second = _due_work(engine, clock)
    engine.firer.fire(first, second)
    assert engine.firer.ahead.pending
    token = engine.runners[1].token
    # Counted and committed before its batch (read from this test's own connection).
    engine.firer.ahead.wait()
    assert set(_rows(second).values()) == {("pending", 1, token)}
    engine.firer.fire(second)
    assert count_threads[0] == threading.current_thread().name  # the first, in the loop
    assert count_threads[1].startswith("durable-count")  # the second, ahead
    assert len(count_threads) == 2  # counted once each
    assert set(_rows(first + second).values()) == {("fired", 1, None)}
    assert FireRecord.objects.count() == 6


def test_the_count_ahead_starts_once_every_handler_of_the_batch_ran(engine, clock, monkeypatch):
    """A handler that takes the process down then costs the next batch nothing."""
    first, second = _due_work(engine, clock)
    ran_before: list[int] = []
    real = engine.firer.ahead.start

    def start(work):
        ran_before.append(FireRecord.objects.count())  # the batch's open transaction
        real(work)

    monkeypatch.setattr(engine.firer.ahead, "start", start)
    engine.firer.fire(first, second)
    assert ran_before == [3]  # all three handlers of the first batch, then the count
    assert set(_rows(first).values()) == {("fired", 1, None)}


def test_with_a_suspect_to_run_alone_the_count_ahead_waits_for_it(engine, clock, monkeypatch):
    """A suspect (an attempt of it started and never ended: its handler may kill the
    process) runs alone after its batch; the next batch is counted only after it ran."""
    first, second = _due_work(engine, clock)
    runner, ids = first[0]
    Timer.objects.filter(id=ids[0]).update(attempts=1, claim_token=runner.token)
    suspect_key = Timer.objects.get(id=ids[0]).key
    ran_before: list[list[str]] = []
    real = engine.firer.ahead.start

    def start(work):
        ran_before.append(sorted(FireRecord.objects.values_list("key", flat=True)))
        real(work)

    monkeypatch.setattr(engine.firer.ahead, "start", start)
    engine.firer.fire(first, second)
    assert len(ran_before) == 1 and len(ran_before[0]) == 3
    assert suspect_key in ran_before[0]  # it ran (alone, last) before the count started
    assert Timer.objects.get(id=ids[0]).attempts == 2
    engine.firer.fire(second)
    assert set(_rows(second).values()) == {("fired", 1, None)}


def test_a_count_whose_batch_does_not_run_is_given_back(engine, clock):
    first, second = _due_work(engine, clock)
    engine.firer.fire(first, second)
    engine.firer.ahead.drop()  # the turn's budget ran out, say
    assert not engine.firer.ahead.pending
    assert set(_rows(second).values()) == {("pending", 0, None)}
    engine.firer.fire(second)  # counted again when it does run: one attempt
    assert set(_rows(second).values()) == {("fired", 1, None)}


def test_a_count_made_for_other_work_is_given_back_and_the_batch_counted_anew(
    engine, clock, count_threads
):
    first, second = _due_work(engine, clock)
    engine.firer.fire(first, second)
    runner, ids = second[0]
    left_out = ids[-1]
    engine.firer.fire([(runner, ids[:-1])])  # a different batch than the one counted
    assert len(count_threads) == 3  # first, second ahead, then the batch run now
    rows = _rows(second)
    assert rows.pop(left_out) == ("pending", 0, None)  # its attempt given back
    assert set(rows.values()) == {("fired", 1, None)}


def test_inside_a_transaction_counts_run_in_the_loop(engine, clock, count_threads):
    """Another connection could not see a transaction's rows (a test's, say)."""
    first, second = _due_work(engine, clock)
    with transaction.atomic():
        assert not engine.firer.ahead.enabled()
        engine.firer.fire(first, second)
        assert not engine.firer.ahead.pending
        engine.firer.fire(second)
    assert count_threads == [threading.current_thread().name] * 2
    assert set(_rows(first + second).values()) == {("fired", 1, None)}
    assert engine.firer.ahead.enabled()


def test_a_drain_over_several_batches_fires_each_timer_once(start_engine, clock):
    engine = start_engine({"SHARDS": SHARDS, "BATCH_SIZE": 7, "RESCAN_INTERVAL_S": 1.0})
    total = 60
    durable.schedule_many(
        {"fn": probes.record, "args": [f"d{i:02}"], "key": f"d{i:02}"} for i in range(total)
    )
    clock.advance(5_000)  # past the next rescan, which loads them: nine batches or so
    for _ in range(10):
        if not engine.tick():
            break
    assert sorted(FireRecord.objects.values_list("key", flat=True)) == [
        f"d{i:02}" for i in range(total)
    ]
    assert set(Timer.objects.values_list("state", "attempts", "claim_token")) == {
        ("fired", 1, None)
    }
    assert not engine.firer.ahead.pending
