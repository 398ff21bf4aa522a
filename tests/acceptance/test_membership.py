"""Workers joining and leaving: fair shares while timers keep firing, and a clean SIGTERM."""

from __future__ import annotations

import math
import signal
import subprocess
import time
from datetime import UTC, datetime

import pytest

import durable
from durable.models import ShardLease, Timer, WorkerNode
from testproject.demo import probes
from tests.acceptance.helpers import (
    SHARDS,
    assert_exactly_once,
    fired_count,
    lease_owners,
    metric,
    now_ms,
    owned_by,
    progress,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]


@pytest.mark.postgres
def test_third_worker_takes_its_share_while_timers_fire(workers, record_property):
    workers.start("w1")
    workers.start("w2")
    workers.wait_until(
        lambda: len(owned_by("w1")) == len(owned_by("w2")) == SHARDS // 2,
        timeout_s=30,
        what="w1 and w2 sharing the shards evenly",
        require_alive=["w1", "w2"],
    )
    # Long enough that the join and the rebalance happen while timers still come due,
    # even on a loaded machine where renewals lag and shards move more than once.
    count, spread_ms = 6_000, 30_000
    first = now_ms() + 2_000
    durable.schedule_many(
        {
            "fn": probes.record,
            "args": [f"j{i}"],
            "at": datetime.fromtimestamp((first + i * spread_ms // count) / 1000, tz=UTC),
        }
        for i in range(count)
    )
    workers.wait_until(
        lambda: fired_count("j") >= count // 5,
        timeout_s=30,
        what="a fifth of the timers fired",
        require_alive=["w1", "w2"],
    )
    workers.start("w3")
    share = math.ceil(SHARDS / 3)

    held: dict[str, int] = {}

    def balanced() -> bool:
        owners = lease_owners()
        held.update((name, len(owners.get(name, []))) for name in ("w1", "w2", "w3"))
        return sum(held.values()) == SHARDS and max(held.values()) <= share

    took = workers.wait_until(
        balanced,
        timeout_s=30,
        what=f"every shard owned, nobody above ceil({SHARDS}/3) = {share}",
        require_alive=["w1", "w2", "w3"],
        explain=lease_owners,
    )
    fired_at_balance = fired_count("j")
    metric(record_property, "rebalance_after_start_s", round(took, 2))
    metric(record_property, "shares", dict(held))
    assert held["w3"] >= SHARDS - 2 * share, held  # 20: the others keep at most 22 each
    assert fired_at_balance < count, "all fired before the rebalance: the join was not tested"

    workers.wait_until(
        lambda: fired_count("j") >= count and not Timer.objects.filter(state="pending").exists(),
        timeout_s=60,
        what=f"all {count} timers fired",
        require_alive=["w1", "w2", "w3"],
        explain=lambda: progress("j"),
    )
    assert_exactly_once((f"j{i}" for i in range(count)), "j", workers)
    # w3 fired part of it under its own tokens.
    by_w3 = sum(
        Timer.objects.filter(shard=s, fired_token=t).count()
        for s, t in workers.workers["w3"].leases_taken()
    )
    assert by_w3 > 0, f"w3 fired nothing\n{workers.logs()}"
    metric(record_property, "fired_by_w3", by_w3)
    lost = sum(len(w.events("lease.lost")) for w in workers.workers.values())
    metric(record_property, "lease_lost_events", lost)


def test_sigterm_releases_leases_and_marks_the_node_stopped(workers, record_property):
    worker = workers.start("t1")
    workers.wait_until(
        lambda: len(owned_by("t1")) == SHARDS,
        timeout_s=30,
        what="t1 holding every shard",
        require_alive=["t1"],
    )
    assert WorkerNode.objects.get(name="t1").stopped_at is None
    start = time.monotonic()
    worker.send(signal.SIGTERM)
    try:
        worker.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"t1 still running 10s after SIGTERM\n{workers.logs()}") from None
    exited = time.monotonic() - start
    metric(record_property, "sigterm_exit_s", round(exited, 2))
    assert worker.proc.returncode == 0, workers.logs()
    assert exited < 5, f"took {exited:.1f}s to stop\n{workers.logs()}"
    assert lease_owners() == {"": list(range(SHARDS))}, workers.logs()
    assert not ShardLease.objects.filter(expires_at__isnull=False).exists()
    node = WorkerNode.objects.get(name="t1")
    assert node.stopped_at is not None and node.shards == [], workers.logs()
    assert len(worker.events("lease.released")) == SHARDS
    assert worker.events("worker.stopped"), workers.logs()
