"""Two real workers, one of them killed with SIGKILL mid-run: nothing lost, doubled or early."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from django.db.models import Min

import durable
from durable.models import ShardLease, Timer
from testproject.demo import probes
from tests.acceptance.helpers import (
    LEASE_TTL_S,
    SHARDS,
    assert_exactly_once,
    fired_count,
    metric,
    now_ms,
    owned_by,
    progress,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def workers(routed_workers):
    """Every test here runs twice: workers connected directly, then through PgBouncer."""
    return routed_workers


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


@pytest.mark.postgres
def test_kill_9_mid_run_loses_and_doubles_nothing(workers, record_property):
    count, lead_ms, spread_ms = 20_000, 4_000, 12_000
    workers.start("w1")
    workers.start("w2")
    workers.wait_until(
        lambda: sorted([len(owned_by("w1")), len(owned_by("w2"))]) == [SHARDS // 2] * 2,
        timeout_s=30,
        what="w1 and w2 sharing the shards evenly",
        require_alive=["w1", "w2"],
    )

    t0 = time.monotonic()
    first_due = now_ms() + lead_ms
    durable.schedule_many(
        {"fn": probes.record, "args": [f"k{i}"], "at": at(first_due + i * spread_ms // count)}
        for i in range(count)
    )
    metric(record_property, "schedule_many_20k_s", round(time.monotonic() - t0, 2))
    metric(record_property, "first_due_in_ms_after_commit", first_due - now_ms())

    # Kill w1 once a good part has fired, and before the rest has. Meanwhile, watch how
    # close the busy workers' leases come to expiring (renewal shares their firing loop).
    margins: list[int] = []

    def progressed() -> bool:
        soonest = ShardLease.objects.exclude(owner="").aggregate(m=Min("expires_at"))["m"]
        if soonest is not None:
            margins.append(int(soonest.timestamp() * 1000) - now_ms())
        return fired_count("k") >= count * 3 // 10

    workers.wait_until(
        progressed,
        timeout_s=60,
        what="30% of the timers fired",
        require_alive=["w1", "w2"],
    )
    workers.workers["w1"].kill()
    killed_ms = now_ms()
    killed = time.monotonic()
    # Its lease rows stay as it left them until they expire.
    victim = dict(ShardLease.objects.filter(owner="w1").values_list("shard", "token"))
    expiry_ms = max(
        int(e.timestamp() * 1000)
        for e in ShardLease.objects.filter(owner="w1").values_list("expires_at", flat=True)
    )
    assert victim, f"w1 held no shard when it was killed\n{workers.logs()}"
    by_victim = sum(
        Timer.objects.filter(shard=s, fired_token=t, state="fired").count()
        for s, t in workers.workers["w1"].leases_taken()
    )
    assert by_victim > 0, f"w1 fired nothing before it was killed\n{workers.logs()}"
    assert fired_count("k") < count, "everything fired before the kill: nothing was tested"
    metric(record_property, "fired_before_kill", fired_count("k"))
    metric(record_property, "w1_shards_at_kill", len(victim))
    metric(record_property, "min_lease_margin_while_busy_ms", min(margins))
    metric(record_property, "fired_by_w1_before_kill", by_victim)
    metric(record_property, "lease_expiry_after_kill_ms", expiry_ms - killed_ms)

    took = workers.wait_until(
        lambda: len(owned_by("w2")) == SHARDS,
        timeout_s=LEASE_TTL_S + 20,
        what="w2 taking over every shard of w1",
        require_alive=["w2"],
    )
    metric(record_property, "takeover_after_kill_s", round(took, 2))
    metric(
        record_property, "takeover_after_expiry_s", round(took - (expiry_ms - killed_ms) / 1000, 2)
    )
    now_tokens = dict(ShardLease.objects.filter(shard__in=victim).values_list("shard", "token"))
    assert all(now_tokens[s] > victim[s] for s in victim), (victim, now_tokens)

    workers.wait_until(
        lambda: fired_count("k") >= count and not Timer.objects.filter(state="pending").exists(),
        timeout_s=90,
        what=f"all {count} timers fired",
        require_alive=["w2"],
        explain=lambda: progress("k"),
    )
    metric(record_property, "all_fired_after_kill_s", round(time.monotonic() - killed, 2))
    assert_exactly_once((f"k{i}" for i in range(count)), "k", workers)

    # The dead worker's backlog: due by the time its leases expired, fired after w2 took
    # them over (under a newer token than w1's last one).
    rows = Timer.objects.filter(shard__in=victim, fire_at_ms__lte=expiry_ms).values_list(
        "shard", "fired_token", "fired_at"
    )
    backlog = [(s, tok, fired_at) for s, tok, fired_at in rows if tok > victim[s]]
    assert backlog, "w1 left no backlog: the takeover catch-up was not exercised"
    last_ms = max(int(fired_at.timestamp() * 1000) for _, _, fired_at in backlog)
    metric(record_property, "backlog_timers", len(backlog))
    lost = [line for w in workers.workers.values() for line in w.events("lease.lost")]
    metric(record_property, "lease_lost_events", len(lost))
    metric(record_property, "backlog_fired_within_s_of_lease_expiry", (last_ms - expiry_ms) / 1000)
