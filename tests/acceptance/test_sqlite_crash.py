"""The embedded setup: one worker on a SQLite file, killed with SIGKILL and started again."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from django.db import connection

import durable
from durable.models import ShardLease, Timer
from testproject.demo import probes
from tests.acceptance.helpers import (
    SHARDS,
    assert_exactly_once,
    fired_count,
    metric,
    now_ms,
    owned_by,
    progress,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _sqlite_only():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite's single-worker set-up; PostgreSQL has the two-worker kill -9 test")


def test_kill_9_and_restart_fires_everything_once(workers, record_property):
    assert workers.database_url.startswith("sqlite:///")
    workers.start("q1")
    workers.wait_until(
        lambda: len(owned_by("q1")) == SHARDS,
        timeout_s=30,
        what="q1 holding every shard",
        require_alive=["q1"],
    )
    count, spread_ms = 2_000, 6_000
    first = now_ms() + 2_000
    durable.schedule_many(
        {
            "fn": probes.record,
            "args": [f"q{i}"],
            "at": datetime.fromtimestamp((first + i * spread_ms // count) / 1000, tz=UTC),
        }
        for i in range(count)
    )
    workers.wait_until(
        lambda: fired_count("q") >= count * 3 // 10,
        timeout_s=30,
        what="30% of the timers fired",
        require_alive=["q1"],
    )
    workers.workers["q1"].kill()
    killed = time.monotonic()
    tokens = dict(ShardLease.objects.values_list("shard", "token"))
    before = fired_count("q")
    assert before < count, "everything fired before the kill: nothing was tested"
    metric(record_property, "fired_before_kill", before)

    # A supervisor restarts it under the same name: it waits for its old leases to expire.
    workers.start("q1")
    workers.wait_until(
        lambda: fired_count("q") >= count and not Timer.objects.filter(state="pending").exists(),
        timeout_s=60,
        what=f"all {count} timers fired after the restart",
        require_alive=["q1"],
        explain=lambda: progress("q"),
    )
    metric(record_property, "all_fired_after_kill_s", round(time.monotonic() - killed, 2))
    assert_exactly_once((f"q{i}" for i in range(count)), "q", workers)
    # The new process holds every shard under new fencing tokens.
    after = dict(ShardLease.objects.filter(owner="q1").values_list("shard", "token"))
    assert sorted(after) == list(range(SHARDS)), workers.logs()
    assert all(after[s] > tokens[s] for s in after), (tokens, after)
