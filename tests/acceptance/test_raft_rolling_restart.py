"""Issue 17, scenario 6: a rolling restart of three Raft nodes under a steady 2,000 fires/s.

Three nodes, Raft on, default settings otherwise. Timers are written ahead, due at
2,000 a second for the whole test; each node in turn is stopped (SIGTERM: it hands its
shards over) and started again, the next one only once the restarted node holds shards
again. Asserted: every timer fires exactly once, none early, none later than 1 s.
"""

from __future__ import annotations

import pytest

import durable
from durable.models import Timer
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.acceptance.helpers import (
    SHARDS,
    assert_exactly_once,
    fired_count,
    metric,
    now_ms,
    progress,
)
from tests.acceptance.raft_cluster import (
    at,
    held,
    led_by_owners,
    raft_cluster,
    skip_without_raft,
    spread_over,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

RATE, SECONDS, LEAD_MS = 2_000, 40, 15_000
MAX_LATENESS_MS = 1_000


def test_rolling_restart_under_2000_fires_per_second_fires_nothing_late(tmp_path, record_property):
    skip_without_raft()
    names = ["n1", "n2", "n3"]
    count = RATE * SECONDS
    with raft_cluster(tmp_path / "logs", SHARDS, proxied=False) as (pool, _, _):
        pool.wait_until(
            lambda: spread_over(names, SHARDS) and led_by_owners(pool, SHARDS),
            timeout_s=90,
            what="three Raft nodes holding every shard between them, each as its leader",
            require_alive=names,
        )
        first_due = now_ms() + LEAD_MS
        for start in range(0, count, 5_000):
            durable.schedule_many(
                {"fn": probes.record, "args": [f"r{i}"], "at": at(first_due + i * 1000 // RATE)}
                for i in range(start, min(count, start + 5_000))
            )
        assert now_ms() < first_due, "writing the timers took longer than the lead"
        pool.wait_until(
            lambda: fired_count("r") > 0,
            timeout_s=LEAD_MS / 1000 + 30,
            what="the first fires",
            require_alive=names,
        )
        restarts = []
        for name in names:
            began = now_ms()
            pool.restart(name)
            took = pool.wait_until(
                lambda n=name: n in held() and spread_over(names, SHARDS),
                timeout_s=60,
                what=f"{name} holding shards again after its restart",
                require_alive=names,
            )
            restarts.append((name, began, round(took, 2)))
        assert now_ms() < first_due + SECONDS * 1000, "the restarts outlasted the load"
        pool.wait_until(
            lambda: (
                fired_count("r") >= count and not Timer.objects.filter(state="pending").exists()
            ),
            timeout_s=SECONDS + 90,
            what=f"all {count} timers fired",
            require_alive=names,
            explain=lambda: progress("r"),
        )

    assert_exactly_once((f"r{i}" for i in range(count)), "r", pool)
    rows = list(
        FireRecord.objects.filter(key__startswith="r").values_list("fired_at_ms", "due_at_ms")
    )
    lateness = sorted(f - d for f, d in rows)
    metric(record_property, "rolling_restarts", restarts)
    metric(record_property, "rolling_p99_ms", lateness[int(len(lateness) * 0.99) - 1])
    metric(record_property, "rolling_max_ms", lateness[-1])
    late = sum(1 for x in lateness if x > MAX_LATENESS_MS)
    assert not late, f"{late} fires later than {MAX_LATENESS_MS} ms (worst {lateness[-1]} ms)"
