"""``DISPATCH = "kombu"``: shipments through kombu's memory transport, run by an executor.

The worker's part (claim the due timer, commit, ship) is done here with the same storage
calls the firer makes, then :class:`ExecutorConsumer` takes the message and completes the
timer; the tests check the fencing on the claim (a redelivered or overtaken shipment is
stale), retries, dead letters and exactly-once effects of atomic handlers.
"""

from __future__ import annotations

import time

import pytest
from django.db import transaction
from kombu import Connection

import durable
from durable.dispatch import kinds
from durable.dispatch.broker import direct_queue
from durable.dispatch.executors import (
    DONE,
    FAILED,
    QUEUE,
    RETRY,
    STALE,
    ExecutorConsumer,
    Shipment,
    ship,
)
from durable.models import ShardLease, Timer
from durable.storage import claims, concurrency
from durable.storage import firing as store
from durable.storage.concurrency import PARKED_MS
from durable.testing import ManualClock, override_clock
from durable.worker.engine import Engine
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.integration import concurrency_support

START_MS = 1_900_000_000_000
MEMORY = "memory://"
TOKEN = 7
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def clock(settings):
    settings.DURABLE = {"SHARDS": 4, "BROKER_URL": MEMORY, "DISPATCH": "kombu"}
    clock = ManualClock(start_ms=START_MS)
    with override_clock(clock):
        with Connection(MEMORY) as conn:
            direct_queue(QUEUE)(conn.default_channel).declare()
            conn.SimpleQueue(QUEUE).clear()
        yield clock


@pytest.fixture
def consumer(clock):
    return ExecutorConsumer(url=MEMORY, db="default", clock=clock, resolvers=kinds.resolvers())


def claim_and_ship(timer: Timer, clock: ManualClock) -> Shipment:
    """The worker's part: count the attempt, lock the due row, claim it, commit, ship a
    pointer to it."""
    tokens = {timer.shard: TOKEN}
    ShardLease.objects.update_or_create(shard=timer.shard, defaults={"token": TOKEN})
    with transaction.atomic():
        counted = claims.count_attempts("default", tokens, [timer.pk], clock.now_ms())
        assert counted.ids == {timer.pk}, counted
    with transaction.atomic():
        [due] = store.lock_due("default", [timer.shard], [timer.pk], clock.now_ms())
        store.claim("default", [due.id], tokens, clock.now_ms() + 300_000)
    shipment = Shipment(timer_id=timer.pk, attempt=due.attempts, shard=due.shard, token=TOKEN)
    ship(shipment, MEMORY)
    return shipment


def keys():
    return sorted(FireRecord.objects.values_list("key", flat=True))


def test_atomic_handler_runs_in_the_completion_transaction(consumer, clock):
    timer = durable.schedule(probes.record, args=["a"])
    claim_and_ship(timer, clock)
    assert consumer.drain() == 1 and consumer.outcomes[DONE] == 1
    row = Timer.objects.get(pk=timer.pk)
    assert (row.state, row.attempts, row.fired_token) == ("fired", 1, TOKEN)
    assert keys() == ["a"]


def test_a_redelivered_shipment_is_stale_and_runs_nothing(consumer, clock):
    timer = durable.schedule(probes.record, args=["once"])
    shipment = claim_and_ship(timer, clock)
    ship(shipment, MEMORY)  # the same message again, as after an executor crash
    assert consumer.drain() == 2
    assert consumer.outcomes == {DONE: 1, RETRY: 0, FAILED: 0, STALE: 1}
    assert keys() == ["once"]


def test_a_shipment_overtaken_by_a_reclaim_is_stale(consumer, clock):
    timer = durable.schedule(probes.record_external, args=["ext"])
    old = claim_and_ship(timer, clock)
    # Its claim expired and the worker fired it again: attempt 2 is the live one.
    Timer.objects.filter(pk=timer.pk).update(claim_expires_ms=clock.now_ms())
    new = claim_and_ship(timer, clock)
    assert (old.attempt, new.attempt) == (1, 2)
    assert consumer.drain() == 2
    assert consumer.outcomes[STALE] == 1 and consumer.outcomes[DONE] == 1
    assert keys() == ["ext"]  # the stale attempt did not run the handler


def test_external_handler_then_on_complete(consumer, clock):
    timer = durable.schedule(probes.record_external, args=["x"], on_complete=probes.outcome)
    claim_and_ship(timer, clock)
    consumer.drain()
    row = Timer.objects.get(pk=timer.pk)
    assert row.state == "fired" and row.result == f"durable:timer:{timer.pk}"
    follow = Timer.objects.get(key=f"on_complete:{timer.pk}")
    assert follow.kwargs["result"] == {"status": "success", "value": row.result}


def test_failure_retries_with_backoff_then_dead_letters(consumer, clock):
    timer = durable.schedule(probes.fail_until, args=["f", 99])  # max_attempts=3
    for attempt in (1, 2, 3):
        claim_and_ship(timer, clock)
        consumer.drain()
        row = Timer.objects.get(pk=timer.pk)
        assert row.attempts == attempt and "planned failure" in row.last_error
        if attempt < 3:
            assert row.state == "pending" and row.fire_at_ms > clock.now_ms()
            clock.advance(row.fire_at_ms - clock.now_ms())
    assert row.state == "failed" and "/srv/app" not in row.last_error
    assert consumer.outcomes[RETRY] == 2 and consumer.outcomes[FAILED] == 1
    assert keys() == []  # every failed attempt rolled its own row back


def test_unknown_handler_is_retried_not_lost(consumer, clock):
    timer = durable.schedule(probes.record, args=["u"])
    Timer.objects.filter(pk=timer.pk).update(target="gone.module.handler")
    claim_and_ship(timer, clock)
    consumer.drain()
    row = Timer.objects.get(pk=timer.pk)
    assert row.state == "pending" and "unknown handler" in row.last_error


@pytest.mark.parametrize("handler", [probes.record, probes.record_external])
def test_a_row_whose_args_is_not_a_list_is_dead_lettered_without_a_call(consumer, clock, handler):
    timer = durable.schedule(handler, args=["a"], max_attempts=5)
    Timer.objects.filter(pk=timer.pk).update(args="abc")  # as raw SQL or an old version could
    claim_and_ship(timer, clock)
    consumer.drain()
    row = Timer.objects.get(pk=timer.pk)
    assert (row.state, row.attempts) == ("failed", 1)
    assert "stored args is a JSON str ('abc'), not an array" in row.last_error
    assert consumer.outcomes[FAILED] == 1 and keys() == []


def test_malformed_messages_are_rejected(consumer, clock):
    with Connection(MEMORY) as conn:
        conn.SimpleQueue(QUEUE).put({"timer_id": "1"}, serializer="json")
    assert consumer.drain() == 1
    assert sum(consumer.outcomes.values()) == 0
    with pytest.raises(ValueError, match="not a durable shipment"):
        Shipment.from_json({"timer_id": 1, "attempt": 1, "shard": 0, "token": True})


def _turns(engine, clock, done, turns=200):
    """Advance 100 ms per turn until ``done()`` (the executor threads work meanwhile)."""
    while not done() and turns:
        clock.advance(100)
        engine.tick()
        turns -= 1
        time.sleep(0.02)


def test_engine_ships_and_an_embedded_executor_completes(clock):
    engine = Engine(node="test-node", clock=clock, threads=2)
    engine.start()
    engine.tick()
    try:
        timers = [durable.schedule(probes.record, args=[f"e{i}"]) for i in range(5)]
        timers.append(durable.schedule(probes.record_external, args=["e-ext"]))
        _turns(engine, clock, lambda: Timer.objects.filter(state="fired").count() == 6)
        assert keys() == ["e-ext", *sorted(f"e{i}" for i in range(5))]
    finally:
        engine.shutdown(wait_s=5)


def test_a_failed_shipment_is_a_failed_attempt_retried_later(clock, settings):
    settings.DURABLE = {**settings.DURABLE, "BROKER_URL": "redis://127.0.0.1:1/0"}
    engine = Engine(node="test-node", clock=clock, threads=2)
    engine.start()
    engine.tick()
    try:
        timer = durable.schedule(probes.record, args=["s"])
        _turns(
            engine,
            clock,
            lambda: (
                Timer.objects.filter(pk=timer.pk, state="pending").exclude(last_error="").exists()
            ),
        )
        row = Timer.objects.get(pk=timer.pk)
        assert row.state == "pending" and "Connection refused" in row.last_error
        assert row.fire_at_ms > timer.fire_at_ms and keys() == []
    finally:
        engine.shutdown(wait_s=5)


def test_an_error_the_bookkeeping_meets_every_time_is_recorded_not_requeued(consumer, clock):
    # A retry time that does not fit the column: recording the failure fails the same
    # way each time. The message must not loop through the queue (it was requeued
    # forever, hundreds of times a second); the timer is dead-lettered with the error.
    timer = durable.schedule(probes.fail_until, args=["bk", 9])
    Timer.objects.filter(pk=timer.pk).update(backoff_base_s=1e300, backoff_max_s=1e300)
    claim_and_ship(timer, clock)
    assert consumer.drain() == 1
    assert consumer.drain() == 0, "the message came back"
    row = Timer.objects.get(pk=timer.pk)
    assert row.state == "failed"
    assert row.last_error.startswith("executing it failed outside its handler:")


def test_a_base_exception_in_an_executed_handler_fails_the_attempt(consumer, clock):
    from testproject.demo import poison

    timer = durable.schedule(poison.external_poison, args=["SystemExit"])
    claim_and_ship(timer, clock)
    assert consumer.drain() == 1 and consumer.outcomes[RETRY] == 1
    row = Timer.objects.get(pk=timer.pk)
    assert row.state == "pending" and "HandlerAborted" in row.last_error


def test_a_redelivery_after_the_executor_died_fails_the_attempt_not_runs_it_again(consumer, clock):
    from durable.storage import timers as timer_store

    timer = durable.schedule(probes.record_external, args=["died"])  # max_attempts=2
    shipment = claim_and_ship(timer, clock)
    # An executor took the message and died in the handler (os._exit, say): the mark it
    # committed before running stays, and the broker redelivers the message.
    assert timer_store.start_execution("default", timer.pk, shipment.attempt, TOKEN) == "started"
    assert consumer.drain() == 1 and consumer.outcomes[RETRY] == 1
    row = Timer.objects.get(pk=timer.pk)
    assert row.state == "pending" and "AttemptsExhausted" in row.last_error
    assert "taken by an executor that died" in row.last_error
    assert keys() == [], "the handler did not run again"


def test_give_up_in_an_executor_dead_letters_at_once(consumer, clock):
    from tests.integration import give_up_support as h

    declined = durable.schedule(h.declines, args=["k1"])  # atomic, raises GiveUp
    matched = durable.schedule(h.gives_up_on, args=["k2", "KeyError"])  # give_up_on
    for timer in (declined, matched):
        claim_and_ship(timer, clock)
    consumer.drain()
    assert consumer.outcomes[FAILED] == 2 and consumer.outcomes[RETRY] == 0
    first, second = (Timer.objects.get(pk=t.pk) for t in (declined, matched))
    assert (first.state, first.attempts, first.max_attempts) == ("failed", 1, 5)
    assert first.last_error == "GiveUp: card declined for k1 (see payments.py)"
    assert (second.state, second.attempts) == ("failed", 1)
    assert second.last_error.startswith("KeyError: ") and "/srv/" not in second.last_error
    assert keys() == []  # the atomic handler's row rolled back


def test_a_keyed_attempts_end_wakes_the_next_in_its_keys_line(consumer, clock):
    """The executor's completion frees the slot (``execution._settle``), like a worker's."""
    first = durable.schedule(concurrency_support.fails_first, args=["acme", 2])
    waiting = durable.schedule(concurrency_support.fails_first, args=["acme", 3])
    assert first.concurrency_key == waiting.concurrency_key is not None
    claim_and_ship(first, clock)
    # A batch over the key's limit of 1 (its attempt counted) parks the waiting one.
    Timer.objects.filter(pk=waiting.pk).update(attempts=1)
    limits = {waiting.pk: (1, None)}
    with transaction.atomic():
        assert concurrency.admit("default", limits, clock.now_ms(), 16) == {waiting.pk}
    assert Timer.objects.get(pk=waiting.pk).fire_at_ms == PARKED_MS
    clock.advance(10)
    assert consumer.drain() == 1 and consumer.outcomes[DONE] == 1
    assert Timer.objects.get(pk=waiting.pk).fire_at_ms == clock.now_ms()
