"""Behind PgBouncer in transaction mode: everything goes through the pooler but LISTEN.

One PgBouncer with a single server connection per database and user, so every pooled
client shares it: the worker fires through it, the web side (a subprocess: schedule(),
a workflow, the admin) uses it, and a client that comes after them must see the
server's defaults, whatever the worker set. The worker LISTENs on a direct connection
(``DURABLE["LISTEN_DATABASE"]``): with a 30 s rescan interval, every timer firing within
a second of its time can only have been announced by NOTIFY.

The crash, fencing and rescan suites run through PgBouncer too (their ``[pgbouncer]``
runs, tests/acceptance/conftest.py ``routed_workers``).
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import psycopg
import pytest
from django.db import connection

import durable
from durable.storage.notify import CHANNEL
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.acceptance.conftest import pgbouncer_for_test_database
from tests.acceptance.helpers import (
    REPO_ROOT,
    SHARDS,
    WorkerPool,
    app_name,
    fired_count,
    metric,
    now_ms,
    owned_by,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


def show(url: str, setting: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(f"SHOW {setting}").fetchone()[0]


def backend_pid(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT pg_backend_pid()").fetchone()[0]


def worker_sessions(name: str) -> list[tuple[int, str]]:
    """``(pid, query)`` of the server sessions whose application_name is the worker's."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE application_name = %s",
            [app_name(name)],
        )
        return cursor.fetchall()


def test_everything_but_listen_goes_through_pgbouncer_and_no_setting_leaks(
    durable_settings, tmp_path, record_property
):
    bouncer, pooled, direct = pgbouncer_for_test_database(pool_size=1)
    try:
        (tmp_path / "logs").mkdir()
        pool = WorkerPool(
            database_url=pooled,
            log_dir=tmp_path / "logs",
            env={
                "DURABLE_LISTEN_DATABASE_URL": direct,
                # Only NOTIFY can bring a timer in within a second of its time.
                "DURABLE_RESCAN_INTERVAL_S": "30",
                "DURABLE_LEASE_TTL_S": "40",
            },
        )
        try:
            run(pool, bouncer, pooled, direct, record_property)
        finally:
            pool.stop_all()
    finally:
        bouncer.destroy()


def run(pool: WorkerPool, bouncer, pooled: str, direct: str, record_property) -> None:
    worker = pool.start("w")
    pool.wait_until(
        lambda: len(owned_by("w")) == SHARDS and len(worker.events("shard.loaded")) == SHARDS,
        timeout_s=60,
        what="w holding and having loaded every shard",
        require_alive=["w"],
    )
    # The web side, through the pooler, in another process.
    web = subprocess.run(
        [sys.executable, "-m", "tests.acceptance.pooled_web", "web", "5"],
        cwd=REPO_ROOT,
        env={**pool.env, "PGAPPNAME": "durable-web"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert web.returncode == 0, f"{web.stdout}\n{web.stderr}"
    assert web.stdout.split() == ["ok", str(bouncer.port)], web.stdout

    # One schedule() per timer, each committed on its own: each NOTIFY names its timer.
    count, first_due = 20, now_ms() + 1_500
    for i in range(count):
        due = first_due + i * 100
        at = datetime.fromtimestamp(due / 1000, tz=UTC)
        durable.schedule(probes.record, args=[f"n{i}"], at=at)
    pool.wait_until(
        lambda: fired_count("n") == count and fired_count("web") == 5 and fired_count("w900"),
        timeout_s=20,
        what="every timer and the workflow fired through the pooler",
        require_alive=["w"],
    )
    lateness = [
        fired - due
        for fired, due in FireRecord.objects.filter(key__startswith="n").values_list(
            "fired_at_ms", "due_at_ms"
        )
    ]
    metric(record_property, "pgbouncer_notify_max_lateness_ms", max(lateness))
    late = f"lateness {sorted(lateness)}: NOTIFY did not arrive"
    assert max(lateness) < 1_000, f"{late}\n{pool.logs()}"
    assert min(lateness) >= 0, "fired early"

    # pool_size 1: every pooled client gets the one server connection the worker used.
    shared = backend_pid(pooled)
    assert backend_pid(pooled) == shared
    assert show(pooled, "idle_in_transaction_session_timeout") == "0"
    assert show(pooled, "synchronous_commit") == "on"
    # The worker's sessions: the shared one (through the pooler) and its direct LISTEN.
    sessions = dict(worker_sessions("w"))
    listen = [pid for pid, query in sessions.items() if query == f"LISTEN {CHANNEL}"]
    assert len(listen) == 1 and listen[0] != shared, sessions
    assert set(sessions) <= {shared, listen[0]}, sessions
