"""PostgreSQL NOTIFY from the scheduling transaction: sent at commit, never on rollback.

A separate psycopg connection LISTENs, as the worker does. To prove that something was
*not* announced without waiting for silence, each test then commits a marker timer and
checks that the marker's notice is the first one to arrive (notices come in commit order).
"""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from django.db import connection, transaction
from django.test.utils import override_settings

import durable
from durable.models import Timer
from durable.storage.notify import CHANNEL, parse
from durable.testing import ManualClock, override_clock
from testproject.demo import handlers as h

NOW = 1_700_000_000_000
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def clock():
    with override_clock(ManualClock(start_ms=NOW)) as manual:
        yield manual


@pytest.fixture
def listener():
    params = connection.get_connection_params()
    conn = psycopg.connect(
        host=params.get("host"),
        port=params.get("port"),
        user=params.get("user"),
        password=params.get("password"),
        dbname=params.get("dbname"),
        autocommit=True,
    )
    conn.execute(f"LISTEN {CHANNEL}")
    yield conn
    conn.close()


def next_payload(listener, timeout: float = 10.0) -> str | None:
    for notice in listener.notifies(timeout=timeout, stop_after=1):
        return notice.payload
    return None


def marker_is_next(listener) -> None:
    marker = durable.schedule(h.noop)
    assert next_payload(listener) == f"{marker.shard},{marker.pk},{marker.fire_at_ms}"


def test_near_term_timer_is_announced_only_at_commit(clock, listener):
    with transaction.atomic():
        timer = durable.schedule(h.noop, delay=timedelta(seconds=30))
        assert next_payload(listener, timeout=0.2) is None  # not before commit
    assert next_payload(listener) == f"{timer.shard},{timer.pk},{NOW + 30_000}"


def test_rolled_back_timer_is_never_announced(clock, listener):
    with transaction.atomic():
        durable.schedule(h.noop)
        transaction.set_rollback(True)
    marker_is_next(listener)


def test_timer_beyond_the_horizon_is_not_announced(clock, listener):
    durable.schedule(h.noop, delay=timedelta(hours=2))  # horizon: 64 x 65.5 s ~ 70 min
    marker_is_next(listener)


def test_existing_key_is_not_announced_again(clock, listener):
    first = durable.schedule(h.noop, key="once")
    assert next_payload(listener) == f"{first.shard},{first.pk},{first.fire_at_ms}"
    durable.schedule(h.noop, key="once")
    marker_is_next(listener)


def test_notify_setting_off_sends_nothing(clock, listener):
    with override_settings(DURABLE={"NOTIFY": False}):
        durable.schedule(h.noop)
    marker_is_next(listener)


def test_a_large_schedule_many_asks_each_near_shard_to_rescan_once(clock, listener):
    # More than PER_TIMER_NOTICES (256) near timers: one "rescan shard" notice per shard.
    timers = durable.schedule_many(
        [{"fn": h.noop, "args": [i]} for i in range(300)]
        + [{"fn": h.noop, "key": "far", "delay": timedelta(days=1)}]
    )
    notices = parse(next_payload(listener))
    near_shards = {t.shard for t in timers[:300]}
    assert {n.shard for n in notices} == near_shards
    assert all(n.timer_id is None for n in notices)  # "<shard>,*": rescan, not one per timer
    assert len(notices) == len(near_shards)
    marker_is_next(listener)


def test_a_small_schedule_many_announces_each_timer_in_one_payload(clock, listener):
    timers = durable.schedule_many([{"fn": h.noop, "args": [i]} for i in range(20)])
    notices = parse(next_payload(listener))  # one pg_notify for the 20
    assert [(n.shard, n.timer_id, n.fire_at_ms) for n in notices] == [
        (t.shard, t.pk, NOW) for t in timers
    ]
    marker_is_next(listener)


def test_on_complete_followup_is_announced_with_the_cancel(clock, listener):
    timer = durable.schedule(h.noop, delay=timedelta(days=1), on_complete=h.on_done)
    durable.cancel(timer)
    followup = Timer.objects.get(key=f"on_complete:{timer.pk}")
    assert next_payload(listener) == f"{followup.shard},{followup.pk},{NOW}"


# --- a forged flood (issue 18): any role may NOTIFY on the channel -----------------------


def forge(parts: list[str]) -> None:
    """Send ``parts`` on the channel as another role could, in payloads under 8,000 bytes."""
    payloads, current = [], ""
    for part in parts:
        if current and len(current) + len(part) + 1 > 7_900:
            payloads.append(current)
            current = ""
        current = f"{current};{part}" if current else part
    payloads.append(current)
    with connection.cursor() as cursor:
        for payload in payloads:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])


def counting_rescans(engine) -> dict[int, int]:
    """Count each runner's rescans (the real method still runs)."""
    counts = dict.fromkeys(engine.runners, 0)
    for shard, runner in engine.runners.items():

        def rescan(now_ms, _shard=shard, _real=runner.rescan):
            counts[_shard] += 1
            return _real(now_ms)

        runner.rescan = rescan
    return counts


@pytest.fixture
def listening():
    """Open an engine's LISTEN session now (it opens at the first wait); closed at the end."""
    engines = []

    def listen(engine) -> None:
        engines.append(engine)
        assert engine.listener.wait(0) == []

    yield listen
    for engine in engines:
        engine.listener.close()


@pytest.mark.parametrize("with_rescans", [False, True], ids=["ids", "ids+rescans"])
def test_a_forged_flood_costs_one_rescan_per_shard_per_wait_and_a_bounded_load(
    start_engine, clock, listening, with_rescans
):
    from durable.worker.listener import MAX_TIMERS_PER_WAIT

    engine = start_engine({"SHARDS": 4})
    listening(engine)
    real = durable.schedule(h.noop, delay=timedelta(seconds=1))  # announced for real
    forged = [f"{i % 4},{10_000_000 + i},{NOW + 500}" for i in range(8_000)]
    if with_rescans:
        forged += [f"{i % 4},*" for i in range(2_000)]
    forge(forged)
    rescans = counting_rescans(engine)
    waits = []  # (wheel entries added, rescans per shard) of each wait
    while len(waits) < 100:
        before = sum(len(r.wheel) for r in engine.runners.values())
        counted = dict(rescans)
        engine._sleep()  # one wait: reads what has arrived (libpq reads ~16 KB at a time)
        added = sum(len(r.wheel) for r in engine.runners.values()) - before
        waits.append((added, {s: rescans[s] - counted[s] for s in rescans}))
        if not added and not any(waits[-1][1].values()):
            break  # nothing was left queued
    assert len(waits) > 1
    for added, per_shard in waits:
        assert added <= MAX_TIMERS_PER_WAIT, waits
        assert max(per_shard.values()) <= 1, waits
    assert sum(added for added, _ in waits) <= 8_001
    if with_rescans:  # the rescan requests came: each shard was rescanned, once a wait
        assert all(rescans[s] >= 1 for s in rescans), rescans
    assert real.pk in engine.runners[real.shard].wheel  # the real notice is not lost
    # The forged ids fire nothing (there are no such rows); the real timer fires.
    clock.advance(timedelta(seconds=1))
    assert engine.tick() == 1
    assert Timer.objects.get(pk=real.pk).state == "fired"


def test_sort_notices_caps_the_ids_and_dedupes_the_rescans():
    from durable.worker.listener import sort_notices

    owned = {0, 1, 2}  # shard 3 is another worker's
    flood = ";".join(
        [f"{i % 4},{10_000_000 + i},{NOW}" for i in range(8_000)] + ["1,*"] * 500 + ["3,*"]
    )
    rescans, overflowed, timers = sort_notices(parse(flood), owned, cap=1_000)
    assert rescans == {1}  # once, however often it was asked; never a shard not owned
    assert len(timers) == 1_000
    assert {n.shard for n in timers} == {0, 2}  # shard 1 is rescanned: its ids are not needed
    assert overflowed == {0, 2}  # past the cap: rescanned next turn instead
    assert sort_notices(parse("0,5,7"), owned) == (set(), set(), [parse("0,5,7")[0]])
