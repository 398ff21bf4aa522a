"""Workflows in real ``run_timer_shards`` processes on PostgreSQL: kill -9, restarts, volume.

Worker subprocesses run on the real clock, so sleeps here are real (3 s) and every wait
is a poll with a deadline. The workers run the default settings: a run killed
mid-replay is replayed by the worker that takes its shard over, as soon as it does (its
wake-up's claim belongs to the dead worker's lease token), not when the claim expires.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.db import connection
from django.db.models import Count

from durable.models import WorkflowRun, WorkflowStep
from durable.workflows import runs
from testproject.demo.models import FireRecord
from tests.acceptance import workflows as wf
from tests.acceptance.helpers import (
    SHARDS,
    WorkerPool,
    database_url,
    fired_count,
    metric,
    now_ms,
    owned_by,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def cluster(transactional_db, durable_settings, tmp_path: Path):
    """Worker subprocesses running the workflow settings, stopped at the end."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    pool = WorkerPool(database_url=database_url(connection.settings_dict), log_dir=log_dir)
    try:
        yield pool
    finally:
        pool.stop_all()


def states() -> dict[str, int]:
    rows = WorkflowRun.objects.values("state").annotate(n=Count("id"))
    return {row["state"]: row["n"] for row in rows}


def exact(key: str) -> int:
    return FireRecord.objects.filter(key=key).count()


def start_and_own_all(cluster: WorkerPool, *names: str) -> None:
    for name in names:
        cluster.start(name)
    cluster.wait_until(
        lambda: sum(len(owned_by(name)) for name in names) == SHARDS,
        timeout_s=30,
        what=f"{', '.join(names)} owning every shard",
        require_alive=names,
    )


def test_kill_9_mid_step_reruns_outside_steps_and_never_doubles_atomic_ones(cluster, tmp_path):
    start_and_own_all(cluster, "w1")
    outside_marker, atomic_marker = tmp_path / "outside", tmp_path / "atomic"
    outside = wf.crash_in_outside_step.start("out", str(outside_marker), 60)
    atomic = wf.crash_in_atomic_step.start("atom", str(atomic_marker), 60)
    cluster.wait_until(
        lambda: outside_marker.exists() and atomic_marker.exists(),
        timeout_s=30,
        what="both steps running in w1",
        require_alive=["w1"],
    )
    cluster.workers["w1"].kill()
    # The outside step's row committed before the crash; the atomic step's did not.
    assert exact("out") == 1 and exact("atom") == 0
    assert not WorkflowStep.objects.exists(), "nothing of either step was recorded"
    started = time.monotonic()
    start_and_own_all(cluster, "w2")
    cluster.wait_until(
        lambda: states() == {"completed": 2},
        timeout_s=45,
        what="both runs completed by w2",
        require_alive=["w2"],
        explain=states,
    )
    assert exact("out") == 2, "the outside step ran again (at least once)"
    assert exact("atom") == 1, "the atomic step's effect committed exactly once"
    assert exact("out:after") == 1 and exact("atom:after") == 1
    assert WorkflowRun.objects.get(pk=outside.pk).result == "done"
    assert WorkflowRun.objects.get(pk=atomic.pk).result == "done"
    print(f"METRIC recovered_after_s={time.monotonic() - started:.1f}")


def test_a_sleep_resumes_across_a_worker_restart_and_never_early(cluster, record_property):
    start_and_own_all(cluster, "w1")
    started = [wf.sleep_then_record.start(f"s{i}", 3) for i in range(20)]
    cluster.wait_until(
        lambda: states() == {"sleeping": 20},
        timeout_s=20,
        what="20 runs sleeping",
        explain=states,
    )
    assert cluster.workers["w1"].stop() == 0  # SIGTERM: a clean stop while they sleep
    start_and_own_all(cluster, "w2")
    cluster.wait_until(
        lambda: states() == {"completed": 20},
        timeout_s=30,
        what="20 runs woken by the new worker",
        require_alive=["w2"],
        explain=states,
    )
    rows = list(FireRecord.objects.filter(key__startswith="s"))
    assert len(rows) == 20 and {r.key for r in rows} == {f"s{i}" for i in range(20)}
    lateness = sorted(r.fired_at_ms - r.due_at_ms for r in rows)
    assert lateness[0] >= 0, f"woke early: {lateness}"
    metric(record_property, "restart_wake_lateness_max_ms", lateness[-1])
    assert {run.pk for run in started} == set(runs().values_list("pk", flat=True))


def test_a_thousand_concurrent_workflows_complete_exactly_once(cluster, record_property):
    start_and_own_all(cluster, "w1", "w2")
    begun = time.monotonic()
    wf.three_steps.start_many([{"args": [i]} for i in range(1000)])
    metric(record_property, "start_many_1000_s", round(time.monotonic() - begun, 3))
    cluster.wait_until(
        lambda: fired_count("w") >= 300,
        timeout_s=60,
        what="30% of the runs recorded",
        require_alive=["w1", "w2"],
    )
    cluster.workers["w1"].kill()  # mid-flight: w2 takes its shards and replays its runs
    killed_at = now_ms()
    cluster.wait_until(
        lambda: states() == {"completed": 1000},
        timeout_s=150,  # about 20 s on an idle machine; generous for a loaded CI box
        what="1000 runs completed",
        require_alive=["w2"],
        explain=states,
    )
    metric(record_property, "thousand_runs_s", round(time.monotonic() - begun, 2))
    metric(record_property, "after_kill_ms", now_ms() - killed_at)
    keys = list(FireRecord.objects.filter(key__startswith="w").values_list("key", flat=True))
    assert len(keys) == 1000 and set(keys) == {f"w{i}" for i in range(1000)}
    results = set(runs().values_list("result", flat=True))
    assert results == {4 * i for i in range(1000)}
    assert WorkflowStep.objects.count() == 3000
