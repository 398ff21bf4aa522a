"""A stop (SIGTERM) during a long turn ends the turn after the batch in progress.

The worker promises to exit within ``SHUTDOWN_GRACE_S`` plus one batch: a turn with a
backlog of many batches must not run to its end first (20 batches of 500 are up to 20
``BATCH_TIME_BUDGET_S``). What it leaves stays pending, for the shard's next owner.
"""

from __future__ import annotations

import pytest

import durable
from durable.models import ShardLease, Timer
from durable.worker.engine import Engine
from testproject.demo.models import FireRecord

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
