"""``durable.schedule_celery`` through the in-process engine and kombu's memory transport.

What the worker publishes is compared with what Celery itself builds for the same task
(``app.amqp.as_task_v2``), so a drift from Celery's protocol fails here. Real brokers and
a real Celery worker are in ``tests/acceptance/test_celery_brokers.py``.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

import pytest
from django.db import transaction
from kombu import Connection

import durable
from durable.dispatch import celery as celery_kind
from durable.dispatch.broker import DeferredPublishError, publishers
from durable.exceptions import PayloadError
from durable.models import Timer
from durable.worker.engine import Engine
from tests.integration.polling import wait_for as _wait_for

START_MS = 1_900_000_000_000
MEMORY = "memory://"
REDIS = "redis://127.0.0.1:6379/14"  # a database of the machine's Redis no one else uses
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def engine(start_engine, settings):
    settings.DURABLE = {
        "SHARDS": 4,
        "LEASE_TTL_S": 10.0,
        "RESCAN_INTERVAL_S": 1.0,
        "BROKER_URL": MEMORY,
        "BACKOFF_BASE_S": 1.0,
    }
    for name in ("celery", "priority"):
        _drain(name)
    return start_engine(None)


def _drain(queue: str) -> list:
    """Every message waiting on ``queue`` of the in-process memory broker (acked)."""
    messages = []
    with Connection(MEMORY) as conn:
        simple = conn.SimpleQueue(queue)
        while True:
            try:
                message = simple.get(block=False)
            except simple.Empty:
                break
            message.ack()
            messages.append(message)
        simple.close()
    return messages


def _fire(engine, clock, ms=1_000):
    clock.advance(ms)
    engine.tick()


def _state(timer):
    return Timer.objects.get(pk=timer.pk).state


def test_publishes_celery_protocol_v2_json_when_due(engine, clock):
    timer = durable.schedule_celery(
        "shop.tasks.ship", args=[7, "x"], kwargs={"fast": True}, delay=timedelta(seconds=30)
    )
    assert timer.kind == "celery" and timer.target == "shop.tasks.ship"
    _fire(engine, clock, 29_000)
    assert _drain("celery") == [], "published early"
    _fire(engine, clock, 1_000)
    assert _wait_for(lambda: _state(timer) == "fired")
    [message] = _drain("celery")
    task_id = f"durable-{timer.pk}"
    assert message.content_type == "application/json"
    assert message.properties["correlation_id"] == task_id
    assert message.properties["delivery_mode"] == 2  # persistent
    assert message.payload == [
        [7, "x"],
        {"fast": True},
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
    ]
    expected = _celery_headers(task_id, "shop.tasks.ship", [7, "x"], {"fast": True})
    got = {k: message.headers[k] for k in expected}
    assert got == expected
    assert message.headers["origin"].startswith("durable")


def _celery_headers(task_id, name, args, kwargs):
    """The headers Celery's own client builds for the same call (minus the origin)."""
    from celery import Celery

    app = Celery("reference", broker=MEMORY, set_as_current=False)
    built = app.amqp.as_task_v2(task_id, name, args=args, kwargs=kwargs)
    headers = dict(built.headers)
    headers.pop("origin")
    headers["timelimit"] = list(headers["timelimit"])
    return headers


def test_queue_routes_to_that_queue_and_the_task_never_sees_the_option(engine, clock):
    timer = durable.schedule_celery("t.prio", kwargs={"n": 1}, queue="priority")
    assert timer.kwargs == {"n": 1, celery_kind.OPTIONS_KEY: {"queue": "priority"}}
    _fire(engine, clock)
    assert _wait_for(lambda: _state(timer) == "fired")
    assert _drain("celery") == []
    [message] = _drain("priority")
    assert message.payload[1] == {"n": 1}
    assert message.delivery_info["routing_key"] == "priority"


def test_cancelled_before_due_publishes_nothing(engine, clock):
    timer = durable.schedule_celery("t.cancel", delay=timedelta(days=400))
    assert durable.cancel(timer) is True
    assert _state(timer) == "canceled"
    _fire(engine, clock, 400 * 86_400_000)  # (retention prunes the cancelled row meanwhile)
    engine.tick()
    assert _drain("celery") == []
    assert not Timer.objects.filter(pk=timer.pk, state="fired").exists()


def test_key_makes_it_idempotent(engine, clock):
    first = durable.schedule_celery("t.once", args=[1], key="order-9")
    again = durable.schedule_celery("t.once", args=[2], key="order-9")
    assert again.pk == first.pk and Timer.objects.count() == 1
    _fire(engine, clock)
    assert _wait_for(lambda: _state(first) == "fired")
    assert [m.payload[0] for m in _drain("celery")] == [[1]]


def test_rolled_back_schedule_never_publishes(engine, clock):
    with pytest.raises(RuntimeError), transaction.atomic():
        durable.schedule_celery("t.ghost")
        raise RuntimeError("roll back")
    _fire(engine, clock, 5_000)
    assert Timer.objects.count() == 0 and _drain("celery") == []


def test_broker_down_is_retried_with_backoff_and_nothing_is_lost(engine, clock, settings):
    settings.DURABLE = {**settings.DURABLE, "BROKER_URL": "redis://127.0.0.1:1/0"}
    timer = durable.schedule_celery("t.later", args=["kept"])
    _fire(engine, clock)
    assert _wait_for(lambda: Timer.objects.filter(pk=timer.pk, attempts=1, state="pending"))
    row = Timer.objects.get(pk=timer.pk)
    assert row.last_error and row.fire_at_ms > clock.now_ms()  # retry planned, backoff
    settings.DURABLE = {**settings.DURABLE, "BROKER_URL": MEMORY}  # the broker is back
    for _ in range(10):
        _fire(engine, clock, 2_000)
        if _wait_for(lambda: _state(timer) == "fired", timeout_s=1):
            break
    assert _state(timer) == "fired"
    assert [m.payload[0] for m in _drain("celery")] == [["kept"]]
    assert Timer.objects.get(pk=timer.pk).attempts == 2


def test_one_connection_per_thread_is_reused():
    publishers.close()
    message = celery_kind.task_message("t.pool", [], {}, task_id="durable-0")
    queue = celery_kind.direct_queue("pooltest")
    publishers.publish(MEMORY, message, queue)
    first = publishers._slots()[MEMORY].connection
    publishers.publish(MEMORY, message, queue)
    assert publishers._slots()[MEMORY].connection is first
    assert len(_drain("pooltest")) == 2
    publishers.close()
    assert MEMORY not in publishers._slots()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"args": [Decimal("1.5")]}, PayloadError, r"args\[0\]: Decimal is not JSON"),
        ({"kwargs": {"when": datetime(2030, 1, 1)}}, PayloadError, r"kwargs\['when'\]"),
        ({"kwargs": {"__celery__": 1}}, ValueError, "reserved"),
        ({"at": datetime(2030, 1, 1)}, ValueError, "naive datetime"),
        ({"delay": timedelta(seconds=-1)}, ValueError, "delay: must not be negative"),
        ({"queue": ""}, ValueError, "queue: must be 1 to 255"),
        ({"queue": "a b"}, ValueError, "queue: 'a b' contains whitespace"),
        ({"key": ""}, ValueError, "key: must be 1 to 255"),
        ({"max_attempts": 0}, ValueError, "max_attempts: must be >= 1"),
    ],
)
def test_bad_input_raises_naming_the_argument_and_writes_nothing(clock, kwargs, error, match):
    with pytest.raises(error, match=match):
        durable.schedule_celery("t.bad", **kwargs)
    assert Timer.objects.count() == 0


@pytest.mark.parametrize(("name", "match"), [(None, "expected a str"), ("", "1 to 255")])
def test_bad_task_name(clock, name, match):
    with pytest.raises((TypeError, ValueError), match=f"task_name: .*{match}"):
        durable.schedule_celery(name)
    assert Timer.objects.count() == 0


def test_max_attempts_and_backoff_are_stored(clock):
    timer = durable.schedule_celery(
        "t.policy", max_attempts=20, backoff=durable.Backoff(base_s=2.0, max_s=60.0)
    )
    row = Timer.objects.get(pk=timer.pk)
    assert (row.max_attempts, row.backoff_base_s, row.backoff_max_s) == (20, 2.0, 60.0)


def test_a_batch_rolled_back_and_rerun_publishes_once(clock, settings):
    from testproject.demo import probes

    settings.DURABLE = {"SHARDS": 1, "RESCAN_INTERVAL_S": 1.0, "BROKER_URL": MEMORY}
    _drain("celery")
    eng = Engine(node="one-shard", clock=clock, threads=1)
    eng.start()
    eng.tick()
    try:
        timer = durable.schedule_celery("t.rerun", args=["once"])
        # Fires in the same batch, after the publish: the batch rolls back and runs again.
        durable.schedule(probes.fail_until, args=["neighbour", 99], delay=timedelta(0))
        _fire(eng, clock)
        assert _state(timer) == "fired"
        assert [m.payload[0] for m in _drain("celery")] == [["once"]]
    finally:
        eng.executor.shutdown(wait=True)


def test_sent_log_is_bounded():
    log = celery_kind.SentLog(size=2)
    for timer_id in (1, 2, 3):
        log.add(timer_id, 1)
    assert not log.seen(1, 1) and log.seen(2, 1) and log.seen(3, 1)
    assert not log.seen(3, 2)  # another attempt is another publish


# --- deferred publishing (Redis pipelines a firing batch's messages) -----------------------


@pytest.fixture
def redis_db():
    """The machine's Redis, database 14, emptied before and after (skips if unreachable)."""
    import redis

    client = redis.Redis.from_url(REDIS, socket_connect_timeout=1)
    try:
        client.flushdb()
    except redis.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    publishers.close()
    yield client
    publishers.close()
    client.flushdb()


def _message(n: int):
    return celery_kind.task_message("t.deferred", [n], {}, task_id=f"durable-{n}")


def test_deferred_publishes_reach_redis_together_at_the_end_of_the_block(redis_db):
    queue = celery_kind.direct_queue("deferred")
    took: list[int] = []
    with publishers.deferred():
        for n in range(3):
            publishers.publish(REDIS, _message(n), queue, on_sent=lambda n=n: took.append(n))
        assert redis_db.llen("deferred") == 0 and took == []  # held, not sent
    assert redis_db.llen("deferred") == 3 and took == [0, 1, 2]


def test_a_deferred_block_that_raises_sends_nothing(redis_db):
    queue = celery_kind.direct_queue("deferred")
    took: list[int] = []
    with pytest.raises(RuntimeError, match="handler failed"), publishers.deferred():
        publishers.publish(REDIS, _message(1), queue, on_sent=lambda: took.append(1))
        raise RuntimeError("handler failed")
    assert redis_db.llen("deferred") == 0 and took == []
    publishers.publish(REDIS, _message(2), queue)  # the pool still works, at once again
    assert redis_db.llen("deferred") == 1


def test_a_publish_error_swallowed_inside_a_deferred_block_still_fails_it(redis_db):
    queue = celery_kind.direct_queue("deferred")
    took: list[int] = []
    with pytest.raises(DeferredPublishError), publishers.deferred():
        publishers.publish(REDIS, _message(1), queue, on_sent=lambda: took.append(1))
        with pytest.raises(Exception):  # noqa: B017 - the transport's own error
            publishers.publish("redis://127.0.0.1:1/0", _message(2), queue)
    assert took == []  # nothing is reported sent when part of the block was lost


def test_transports_that_cannot_batch_publish_at_once_inside_a_deferred_block():
    queue = celery_kind.direct_queue("immediate")
    took: list[int] = []
    with publishers.deferred():
        publishers.publish(MEMORY, _message(1), queue, on_sent=lambda: took.append(1))
        assert took == [1] and len(_drain("immediate")) == 1


def test_celery_timers_fired_together_on_redis_publish_once_each(clock, settings, redis_db):
    from testproject.demo import probes

    settings.DURABLE = {"SHARDS": 4, "RESCAN_INTERVAL_S": 1.0, "BROKER_URL": REDIS}
    eng = Engine(node="redis-node", clock=clock, threads=1)
    eng.start()
    eng.tick()
    try:
        timers = [durable.schedule_celery("t.batch", args=[n]) for n in range(20)]
        # A failing neighbour in the same batch: the fast path (one pipelined flush) is
        # discarded and the careful redo publishes each message once.
        durable.schedule(probes.fail_until, args=["redis-neighbour", 99], delay=timedelta(0))
        _fire(eng, clock)
        assert all(_state(t) == "fired" for t in timers)
        assert redis_db.llen("celery") == 20
    finally:
        eng.executor.shutdown(wait=True)
