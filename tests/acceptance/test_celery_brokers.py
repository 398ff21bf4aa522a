"""``schedule_celery`` end to end: a real worker publishes to RabbitMQ or Redis, and a stock
Celery worker (``testproject.celery_app``) runs the task, writing one line per execution.

Each broker test is skipped, with the reason, when its broker does not answer on this
machine (CI runs both). The outage test starts a throwaway ``redis-server`` on a spare
port only after the timers are due, so the first publishes fail and are retried.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import pytest

import durable
from durable.models import Timer
from testproject.celery_app import read_executions
from tests.acceptance.helpers import REPO_ROOT, SHARDS, WorkerPool, now_ms, owned_by

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
# A database of its own, so the default "celery" queue here is nobody else's.
REDIS = "redis://127.0.0.1:6379/15"
SPARE_REDIS_PORT = 6390
# The durable worker fires by the database's clock, read through its offset estimate
# (half a round trip, plus millisecond rounding); the Celery worker stamps runs with the
# host's own clock. Durable's own "never early" tests compare on one clock.
CLOCK_SLACK_MS = 5


def _unreachable(url: str) -> str | None:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=1).close()
    except OSError as exc:
        return f"broker {parts.scheme}://{parts.hostname}:{parts.port} unreachable ({exc})"
    return None


def broker_param(url: str, name: str):
    reason = _unreachable(url)
    return pytest.param(url, id=name, marks=pytest.mark.skipif(bool(reason), reason=reason or ""))


BROKERS = [broker_param(RABBITMQ, "rabbitmq"), broker_param(REDIS, "redis")]


@dataclass
class CeleryWorker:
    """A ``celery worker`` subprocess on one broker and queue, logging to a file."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    out_dir: Path

    def executions(self) -> list[dict]:
        """Every task execution the worker recorded so far."""
        return read_executions(self.out_dir)

    def log(self) -> str:
        """The worker's log so far."""
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Stop the worker (TERM, then KILL) and close its log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log_file.close()


@pytest.fixture
def celery_workers(tmp_path):
    """Start Celery workers with ``start(broker_url, queue)``; all stopped at the end."""
    started: list[CeleryWorker] = []

    def start(broker_url: str, queue: str) -> CeleryWorker:
        out_dir = tmp_path / f"celery-{len(started)}"
        out_dir.mkdir()
        log_path = out_dir / "worker.log"
        log_file = log_path.open("ab")
        command = [
            *(sys.executable, "-m", "celery", "-A", "testproject.celery_app", "worker"),
            *("-Q", queue, "-P", "threads", "-c", "4", "-l", "INFO"),
            *("-n", f"test-{uuid.uuid4().hex[:8]}@%h"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        ]
        env = {
            **_environ(),
            "CELERY_BROKER_URL": broker_url,
            "CELERY_OUT_DIR": str(out_dir),
        }
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT
        )
        worker = CeleryWorker(proc=proc, log_path=log_path, log_file=log_file, out_dir=out_dir)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def _environ() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def _durable_worker(workers: WorkerPool, broker_url: str) -> None:
    workers.env["DURABLE_BROKER_URL"] = broker_url
    workers.start("w1")
    workers.wait_until(
        lambda: len(owned_by("w1")) == SHARDS,
        timeout_s=30,
        what="w1 holding every shard",
        require_alive=["w1"],
    )


def _wait(workers: WorkerPool, celery: CeleryWorker, predicate, *, what: str, timeout_s=60):
    workers.wait_until(
        predicate,
        timeout_s=timeout_s,
        what=what,
        require_alive=["w1"],
        explain=lambda: f"celery worker log:\n{celery.log()[-3000:]}",
    )


@pytest.mark.parametrize("broker_url", BROKERS)
def test_stock_celery_worker_runs_each_task_once_never_early(
    workers, celery_workers, broker_url, durable_settings
):
    queue = f"durable-test-{uuid.uuid4().hex[:8]}"
    celery = celery_workers(broker_url, queue)
    _durable_worker(workers, broker_url)
    count, lead_ms = 30, 2_000
    first_due = now_ms() + lead_ms
    timers = {}
    for i in range(count):
        due = first_due + i * 50
        timers[f"k{i}"] = durable.schedule_celery(
            "testproject.record",
            args=[f"k{i}"],
            kwargs={"due_ms": due},
            at=_at(due),
            queue=queue,
        )
    _wait(
        workers,
        celery,
        lambda: len(celery.executions()) >= count,
        what=f"{count} executions by the Celery worker",
    )
    time.sleep(0.5)  # room for a duplicate to show up
    runs = celery.executions()
    assert sorted(r["key"] for r in runs) == sorted(timers), "lost or duplicated"
    for run in runs:
        assert run["task_id"] == f"durable-{timers[run['key']].pk}"
        assert run["ran_ms"] >= run["due_ms"] - CLOCK_SLACK_MS, f"ran early: {run}"
        assert run["eta"] is None  # nothing waits in the Celery worker's memory
    # The completion commits just after the publish: the task may run before it.
    _wait(
        workers,
        celery,
        lambda: Timer.objects.filter(kind="celery", state="fired").count() == count,
        what="every timer completed",
    )


@pytest.mark.skipif(bool(_unreachable(REDIS)), reason=_unreachable(REDIS) or "")
def test_default_queue_and_an_unregistered_task(workers, celery_workers, durable_settings):
    _purge_default_queue(REDIS)
    celery = celery_workers(REDIS, "celery")
    _durable_worker(workers, REDIS)
    known = durable.schedule_celery("testproject.record", args=["default-queue"])
    unknown = durable.schedule_celery("no.such.task", args=[1])
    _wait(
        workers,
        celery,
        lambda: (
            celery.executions()
            and "no.such.task" in celery.log()
            and Timer.objects.filter(pk__in=[known.pk, unknown.pk], state="fired").count() == 2
        ),
        what="the known task run, the unknown one reported, both timers completed",
    )
    assert [r["key"] for r in celery.executions()] == ["default-queue"]
    # Durable published it (the timer is done, the log names it); Celery rejects it.
    assert Timer.objects.get(pk=unknown.pk).state == "fired"
    assert Timer.objects.get(pk=known.pk).state == "fired"
    assert "Received unregistered task of type 'no.such.task'" in celery.log()
    published = workers.workers["w1"].events("celery.published")
    assert any("task=no.such.task" in line for line in published), workers.logs()


def _purge_default_queue(url: str) -> None:
    from kombu import Connection

    with Connection(url) as conn:
        conn.SimpleQueue("celery").clear()


@pytest.fixture
def spare_redis():
    """A ``redis-server`` on a spare port, started by the test when it wants: ``start()``."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    if not _unreachable(f"redis://127.0.0.1:{SPARE_REDIS_PORT}/0"):
        pytest.skip(f"port {SPARE_REDIS_PORT} is taken; the outage test needs it free")

    def start() -> None:
        subprocess.run(
            ["redis-server", "--port", str(SPARE_REDIS_PORT), "--save", "", "--daemonize", "yes"],
            check=True,
            capture_output=True,
        )

    yield start
    subprocess.run(
        ["redis-cli", "-p", str(SPARE_REDIS_PORT), "shutdown", "nosave"], capture_output=True
    )


def test_broker_down_at_fire_time_is_retried_and_nothing_is_lost(
    workers, celery_workers, spare_redis, durable_settings
):
    url = f"redis://127.0.0.1:{SPARE_REDIS_PORT}/0"
    _durable_worker(workers, url)
    count = 10
    timers = [
        durable.schedule_celery(
            "testproject.record",
            args=[f"down{i}"],
            max_attempts=30,
            backoff=durable.Backoff(base_s=0.2, max_s=1.0),
        )
        for i in range(count)
    ]
    ids = [t.pk for t in timers]
    workers.wait_until(
        lambda: Timer.objects.filter(pk__in=ids, attempts__gte=2, state="pending").count() == count,
        timeout_s=30,
        what="every publish failed twice and is waiting for a retry",
        require_alive=["w1"],
    )
    errors = set(Timer.objects.filter(pk__in=ids).values_list("last_error", flat=True))
    assert all("6390" in e or "onnection" in e for e in errors), errors
    spare_redis()  # the broker comes back
    celery = celery_workers(url, "celery")
    _wait(
        workers,
        celery,
        lambda: len(celery.executions()) >= count,
        what="every task run once the broker is back",
    )
    time.sleep(0.5)
    assert sorted(r["key"] for r in celery.executions()) == sorted(f"down{i}" for i in range(count))
    _wait(
        workers,
        celery,
        lambda: Timer.objects.filter(pk__in=ids, state="fired").count() == count,
        what="every timer completed",
    )


def _at(ms: int):
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms / 1000, tz=UTC)


@pytest.mark.skipif(bool(_unreachable(RABBITMQ)), reason=_unreachable(RABBITMQ) or "")
def test_dispatch_kombu_runs_handlers_in_executor_processes(workers, durable_settings):
    from kombu import Connection

    from durable.dispatch.executors import QUEUE

    with Connection(RABBITMQ) as conn:
        conn.SimpleQueue(QUEUE).clear()
    workers.env["DJANGO_SETTINGS_MODULE"] = "tests.acceptance.executor_settings"
    workers.env["DURABLE_BROKER_URL"] = RABBITMQ
    log_path = workers.log_dir / "executor.log"
    with log_path.open("ab") as log_file:
        executor = subprocess.Popen(
            [sys.executable, "manage.py", "run_durable_executor", "--threads", "4"],
            cwd=REPO_ROOT,
            env=workers.env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        _durable_worker(workers, RABBITMQ)
        _run_through_executor(workers, executor)
    finally:
        executor.terminate()
        executor.wait(timeout=20)
    assert "executor: 4 thread(s)" in log_path.read_text()


def _run_through_executor(workers: WorkerPool, executor: subprocess.Popen[bytes]) -> None:
    from testproject.demo import probes
    from tests.acceptance.helpers import assert_exactly_once

    due = now_ms() + 1_000
    keys = [f"x{i}" for i in range(200)]
    durable.schedule_many({"fn": probes.record, "args": [k], "at": _at(due)} for k in keys)
    workers.wait_until(
        lambda: Timer.objects.filter(state="fired").count() == len(keys),
        timeout_s=60,
        what="every handler run by the executor process",
        require_alive=["w1"],
    )
    assert executor.poll() is None, "the executor process died"
    assert_exactly_once(keys, "x", workers)
