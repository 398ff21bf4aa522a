"""Raft's warm takeover (durable.worker.runner.load_acquired): the new owner's wheel gets
what the standby held, at the standby's times, and the rebuild from the rows that follows
puts right what the standby had wrong. The standby is given by hand; the rows are real."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

import durable
from durable.conf import get_settings
from durable.core.sharding import bucket_of
from durable.models import Timer
from durable.storage import leases
from durable.worker.leasing import Acquired
from durable.worker.runner import load_acquired
from testproject.demo import probes

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_rows_time_wins_over_a_standby_that_missed_a_reschedule():
    conf = get_settings()
    now = int(datetime.now(UTC).timestamp() * 1000)
    timer = durable.schedule(
        probes.record, args=["warm"], at=datetime.fromtimestamp(now / 1000 + 50, UTC)
    )
    leases.ensure_shards("default", conf.SHARDS)
    token = leases.acquire("default", timer.shard, "n2", now, 10)
    assert token is not None
    # Moved 49 s earlier just before its old owner died, and never replicated: the standby
    # still says +50 s.
    soon = now + 1_000
    Timer.objects.filter(pk=timer.pk).update(
        fire_at_ms=soon, bucket=bucket_of(soon, conf.BUCKET_SHIFT)
    )
    got = Acquired(timer.shard, token, "n1", now, standby=((timer.pk, now + 50_000),))
    runner = load_acquired("default", conf, got, now, raft=True)
    assert runner.rebuild_pending and timer.pk in runner.wheel
    assert runner.standby_times == {timer.pk: now + 50_000}
    runner.rebuild_pending = False
    runner.rebuild(now)
    assert runner.due(soon) == [timer.pk]  # at the row's time, not 49 s late
