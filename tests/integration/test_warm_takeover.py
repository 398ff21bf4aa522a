"""Raft's warm takeover (durable.worker.runner.load_acquired): the new owner's wheel gets
what the standby held, at the standby's times; the rows up to the next bucket are read at
once and put right what the standby had wrong; the rest of the horizon comes a few
buckets a turn. The standby is given by hand; the rows are real."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

import durable
from durable.conf import get_settings
from durable.core.sharding import bucket_of
from durable.models import Timer
from durable.storage import leases
from durable.worker.leasing import Acquired
from durable.worker.runner import WARM_BUCKETS_PER_TURN, load_acquired
from testproject.demo import probes

pytestmark = pytest.mark.django_db(transaction=True)


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def test_the_rows_time_wins_and_the_far_horizon_comes_in_turns():
    conf = get_settings()
    now = int(datetime.now(UTC).timestamp() * 1000)
    moved = durable.schedule(probes.record, args=["moved"], at=at(now + 50_000))
    far = durable.schedule(probes.record, args=["far"], at=at(now + 40 * 60_000))
    # The standby's furthest timer, beyond the next bucket: its row is read all the same.
    beyond = durable.schedule(probes.record, args=["beyond"], at=at(now + 190_000))
    Timer.objects.filter(pk__in=[far.pk, beyond.pk]).update(shard=moved.shard)
    leases.ensure_shards("default", conf.SHARDS)
    token = leases.acquire("default", moved.shard, "n2", now, 10)
    assert token is not None
    # Moved 49 s earlier just before its old owner died, and never replicated: the standby
    # still says +50 s.
    soon = now + 1_000
    Timer.objects.filter(pk=moved.pk).update(
        fire_at_ms=soon, bucket=bucket_of(soon, conf.BUCKET_SHIFT)
    )
    standby = ((moved.pk, now + 50_000), (beyond.pk, now + 200_000))
    got = Acquired(moved.shard, token, "n1", now, standby=standby)
    runner = load_acquired("default", conf, got, now, raft=True)
    # The far horizon is not read at the takeover...
    assert runner.paced and far.pk not in runner.wheel
    turns = 0
    while runner.paced:
        runner.load_ahead(now)
        turns += 1
    # ...but a few buckets a turn, until all of it is in.
    assert far.pk in runner.wheel
    assert turns >= (40 * 60_000 >> conf.BUCKET_SHIFT) // WARM_BUCKETS_PER_TURN - 1
    assert runner.due(soon) == [moved.pk]  # at the row's time, not 49 s late
    assert runner.due(now + 190_000) == [beyond.pk]  # not 10 s late
