"""Operating the worker: Prometheus metrics and ``manage.py durable_status``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from io import StringIO

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError

import durable
from durable.testing import override_clock
from durable.worker.engine import Engine
from testproject.demo import probes

START_MS = 1_900_000_000_000
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def engine(start_engine, clock):
    eng = start_engine({"SHARDS": 2, "RESCAN_INTERVAL_S": 1.0}, node="ops-node", threads=1)
    return eng, clock


def sample(engine, name, **labels):
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


def test_fires_lateness_and_errors_are_counted_per_shard(engine):
    eng, clock = engine
    timers = [
        durable.schedule(probes.record, args=[f"m{i}"], delay=timedelta(seconds=1))
        for i in range(6)
    ]
    durable.schedule(probes.fail_until, args=["mx", 99], delay=timedelta(seconds=1))
    clock.advance(1_250)
    eng.tick()
    fired = sum(sample(eng, "durable_timers_fired_total", shard=str(s)) for s in (0, 1))
    assert fired == 6
    shard = str(timers[0].shard)
    assert sample(eng, "durable_fire_lateness_seconds_count", shard=shard) >= 1
    # every fire was 0-250 ms late: all inside the 0.25 s bucket, none in 0.01 s
    assert sample(eng, "durable_fire_lateness_seconds_bucket", shard=shard, le="0.25") == sample(
        eng, "durable_fire_lateness_seconds_count", shard=shard
    )
    errors = sum(sample(eng, "durable_handler_errors_total", shard=str(s)) for s in (0, 1))
    assert errors == 1
    assert sample(eng, "durable_lease_changes_total", event="acquired") == 2
    assert sample(eng, "durable_shards_held") == 2


def test_wheel_depth_gauges(engine):
    eng, clock = engine
    durable.schedule(probes.record, args=["w"], delay=timedelta(minutes=30))
    for runner in eng.runners.values():
        runner.rebuild(clock.now_ms())
    eng.chores.sample(clock.now_ms())
    total = sum(
        sample(eng, "durable_wheel_pending", shard=str(s), level=str(level))
        for s in (0, 1)
        for level in range(6)
    )
    assert total == 1


def test_metrics_are_served_on_loopback(engine):
    eng, _ = engine
    server, thread = eng.metrics.serve(0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        assert b"durable_shards_held" in body
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_status_command_text_and_json(engine):
    eng, clock = engine
    durable.schedule(probes.record, args=["s"])
    durable.schedule(probes.fail_until, args=["dead", 99], max_attempts=1)
    clock.advance(1_000)
    eng.tick()
    out = StringIO()
    with override_clock(clock):
        call_command("durable_status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert [w["name"] for w in data["workers"]] == ["ops-node"]
    assert {s["owner"] for s in data["shards"]} == {"ops-node"}
    assert data["recent"]["fired"] == 1
    assert data["failed"]["count"] == 1
    assert "planned failure" in data["failed"]["latest"][0]["error"]
    text = StringIO()
    with override_clock(clock):
        call_command("durable_status", stdout=text)
    assert "workers: 1 live" in text.getvalue()
    assert "failed timers (dead letter): 1" in text.getvalue()


def test_status_check_exits_by_health(engine):
    eng, clock = engine
    clock.advance(1_000)
    eng.tick()
    with override_clock(clock):
        out = StringIO()
        call_command("durable_status", "--check", stdout=out)  # healthy: no error
        assert out.getvalue().rstrip().endswith("health: ok")
        out = StringIO()
        call_command("durable_status", "--check", "--json", stdout=out)
        assert json.loads(out.getvalue())["health"] == {
            "ok": True,
            "problems": [],
            "max_lag_s": 30.0,
        }
        clock.advance(timedelta(minutes=5))  # the worker stopped turning: leases lapse
        with pytest.raises(CommandError) as exc:
            call_command("durable_status", "--check", stdout=StringIO())
    assert exc.value.returncode == 1
    assert "no live worker" in str(exc.value)
    assert "2 shard(s) without a live owner: 0-1" in str(exc.value)


def test_status_check_says_when_the_database_is_unreachable(tmp_path):
    env = {**os.environ, "DATABASE_URL": "postgres://nobody@127.0.0.1:1/nothing"}
    env.pop("DURABLE_EXPECT_POSTGRES", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "durable_status", "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=settings.BASE_DIR,
    )
    assert done.returncode == 2, done.stderr
    assert "database unreachable" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.postgres
def test_measured_offset_never_puts_the_worker_ahead_of_the_database(settings):
    """The corrected clock may lag the database by a round trip, never lead it."""
    from durable.core.clock import SystemClock
    from durable.storage.leases import database_now_ms

    settings.DURABLE = {"SHARDS": 2}
    clock = SystemClock(offset_ms=50)  # deliberately wrong before measuring
    eng = Engine(node="offset-node", clock=clock, threads=1)
    try:
        eng.chores.measure_offset()
        for _ in range(200):
            mine = clock.now_ms()
            assert mine <= database_now_ms("default"), "worker clock ahead of the database"
    finally:
        eng.executor.shutdown(wait=True)


def test_dead_letters_and_workflow_runs_by_state_are_exported(engine):
    eng, clock = engine
    durable.schedule(probes.fail_until, args=["dl", 99], max_attempts=1)
    clock.advance(1_000)
    eng.tick()
    dead = sum(sample(eng, "durable_timers_dead_lettered_total", shard=str(s)) for s in (0, 1))
    assert dead == 1
    from testproject.demo.workflows import ten_steps

    ten_steps.start(run_id="metrics-run")
    eng.chores.sample_database([0, 1])
    assert sample(eng, "durable_workflow_runs", state="pending") == 1


def test_workflow_step_durations_are_observed(engine):
    from testproject.demo.workflows import ten_steps

    eng, clock = engine
    ten_steps.start(run_id="steps-run")
    for _ in range(20):
        clock.advance(1_000)
        eng.tick()
        if (
            eng.firer.in_flight == 0
            and sample(eng, "durable_workflow_step_seconds_count", kind="step") >= 10
        ):
            break
        time.sleep(0.05)  # the replay runs on the executor thread
    assert sample(eng, "durable_workflow_step_seconds_count", kind="step") >= 10


def test_web_side_serves_django_prometheus_metrics(client):
    client.get("/admin/login/")
    body = client.get("/metrics").content
    assert b"django_http_requests_total_by_method_total" in body
