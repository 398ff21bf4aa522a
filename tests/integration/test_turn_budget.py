"""A backlog is fired over several short turns, not in one long one (issue 17).

A turn fires what its wheels gave out at its start; leases, Raft takeovers, warm
takeovers' rebuilds and the timers newly due all wait for its end. In the Raft rolling
restart a node took over fifteen backlogged shards and spent the next minute in one turn
firing their backlog: shards it led meanwhile went unowned and its newest shard's rows
waited 53 s. A turn now stops firing after ``TURN_BUDGET_MS`` (on the engine's clock)
and puts the rest back in the wheels, due first; the next turn starts after the last
shard it fired in, so no shard's backlog starves another's.
"""

from __future__ import annotations

import pytest

import durable
from durable.models import Timer
from durable.testing import ManualClock
from durable.worker.engine import TURN_BUDGET_MS
from testproject.demo.models import FireRecord

pytestmark = pytest.mark.django_db(transaction=True)

#: Each fire advances this clock by FIRE_MS: a batch of BATCH fires "takes" BATCH * FIRE_MS.
CLOCKS: list[ManualClock] = []
FIRE_MS, BATCH = 10, 10


@durable.handler
def slow_record(key: str) -> None:
    """Record ``key``; firing it takes FIRE_MS of the engine's clock."""
    FireRecord.objects.create(key=key, fired_at_ms=0)
    for clock in CLOCKS:
        clock.advance(FIRE_MS)


def fired_keys() -> list[str]:
    return list(FireRecord.objects.values_list("key", flat=True))


def test_a_backlog_is_fired_over_turns_of_bounded_length_in_every_shard(start_engine, clock):
    engine = start_engine({"SHARDS": 2, "BATCH_SIZE": BATCH})
    assert sorted(engine.runners) == [0, 1]
    total = 200
    durable.schedule_many(
        {"fn": slow_record, "args": [f"b{i:03}"], "key": f"b{i:03}"} for i in range(total)
    )
    assert set(Timer.objects.values_list("shard", flat=True)) == {0, 1}
    clock.advance(5_000)  # past the next rescan, which loads them: a backlog of 200
    CLOCKS.append(clock)
    try:
        started = clock.now_ms()
        first = engine.tick()
        # Not the whole backlog (it "takes" 2 s): one batch past the budget at most.
        assert total * FIRE_MS > TURN_BUDGET_MS
        assert 0 < first < total
        assert first <= (TURN_BUDGET_MS // (FIRE_MS * BATCH) + 1) * BATCH
        assert clock.now_ms() - started <= TURN_BUDGET_MS + FIRE_MS * BATCH
        assert Timer.objects.filter(state="pending").count() == total - first
        # The next turn starts where this one stopped: both shards fire within two turns.
        engine.tick()
        shards = Timer.objects.filter(state="fired").values_list("shard", flat=True)
        assert set(shards) == {0, 1}
        for _ in range(total):  # nothing put back is lost: everything fires, once
            if not engine.tick():
                break
    finally:
        CLOCKS.remove(clock)
    keys = fired_keys()
    assert sorted(keys) == [f"b{i:03}" for i in range(total)]
    assert Timer.objects.filter(state="pending").count() == 0
