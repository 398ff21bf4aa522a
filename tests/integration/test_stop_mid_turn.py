"""A stop (SIGTERM): the turn ends after the batch in progress; the grace period holds
only the shards with handlers in flight, and keeps their leases.

The worker promises to exit within ``SHUTDOWN_GRACE_S`` plus one batch: a turn with a
backlog of many batches must not run to its end first (20 batches of 500 are up to 20
``BATCH_TIME_BUDGET_S``). What it leaves stays pending, for the shard's next owner, who
should not have to wait for a lease TTL to take it.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections

import durable
from durable.models import ShardLease, Timer
from durable.worker.engine import Engine
from testproject.demo.models import FireRecord
from tests.integration.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

#: The engines the handler below stops (as the worker's SIGTERM handler does).
RUNNING: list[Engine] = []


@durable.handler
def record_then_stop(key: str) -> None:
    """Record ``key``; the first one also asks the running engine to stop."""
    FireRecord.objects.create(key=key, fired_at_ms=0)
    for engine in RUNNING:
        engine.stop()


def test_a_stop_mid_turn_fires_no_further_batch(start_engine, clock):
    engine = start_engine({"SHARDS": 1, "BATCH_SIZE": 10})
    RUNNING.append(engine)
    try:
        durable.schedule_many({"fn": record_then_stop, "args": [f"s{i:02}"]} for i in range(50))
        clock.advance(5_000)  # past the next rescan, which loads them
        engine.tick()
    finally:
        RUNNING.remove(engine)
    # One batch (the oldest ten) fired; the other 40 stay pending for the next owner.
    fired = sorted(FireRecord.objects.values_list("key", flat=True))
    assert fired == [f"s{i:02}" for i in range(10)]
    assert Timer.objects.filter(state="pending").count() == 40
    engine.shutdown(wait_s=0)
    assert ShardLease.objects.get(shard=0).owner == ""
    start_engine(None, node="next-owner")  # takes the shard and fires its backlog
    fired = sorted(FireRecord.objects.values_list("key", flat=True))
    assert fired == [f"s{i:02}" for i in range(50)]


# -- the grace period -------------------------------------------------------------------------

RELEASE = threading.Event()


@durable.handler(atomic=False)
def held_open(key: str) -> None:
    """An outside handler that runs until the test lets it finish (10 s at most)."""
    RELEASE.wait(10)
    FireRecord.objects.create(key=key, fired_at_ms=0)


def owners() -> dict[int, str]:
    return dict(ShardLease.objects.values_list("shard", "owner"))


def test_the_grace_period_holds_only_busy_shards_and_keeps_their_leases(start_engine, clock):
    """Waiting for a handler in flight, the stopping worker gives up every other shard at
    once (a peer fires them without waiting for the lease TTL) and keeps renewing the
    busy one, however long the grace, so that the handler's completion still commits."""
    engine = start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0})
    RELEASE.clear()
    timer = durable.schedule(held_open, args=["busy"])
    clock.advance(2_000)
    engine.tick()
    assert wait_for(lambda: engine.firer.in_flight == 1, timeout_s=5)
    token = engine.runners[timer.shard].token
    engine.stop()
    stopping = threading.Thread(target=_closing(lambda: engine.shutdown(wait_s=30)))
    stopping.start()
    try:
        idle = {shard: "" for shard in range(4) if shard != timer.shard}
        assert wait_for(lambda: owners() == {**idle, timer.shard: "test-node"}, 5), owners()
        clock.advance(25_000)  # 2.5 TTLs into the grace: the busy shard's lease is renewed
        assert wait_for(
            lambda: (
                ShardLease.objects.get(shard=timer.shard).expires_at.timestamp() * 1000
                > clock.now_ms()
            ),
            timeout_s=5,
        )
    finally:
        RELEASE.set()
        stopping.join(15)
    row = Timer.objects.get(pk=timer.pk)
    assert (row.state, row.fired_token) == ("fired", token), "its completion committed"
    assert set(owners().values()) == {""}


def _closing(fn):
    def run():
        try:
            fn()
        finally:
            connections.close_all()

    return run
