"""The database goes away under a running worker: it reconnects, loses nothing, doubles nothing.

The restart happens on a throwaway cluster of the test's own (``initdb`` in a temporary
directory, its own port), never on the server the rest of the suite uses.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection

import durable
from durable.testing.cluster import TemporaryCluster
from testproject.demo import probes
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

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres]

DBNAME = "durable_restart"

# Run in a subprocess with DATABASE_URL pointing at the throwaway cluster.
SCHEDULE = """
import sys
from datetime import UTC, datetime

import django

django.setup()

import durable
from durable.core.clock import current_clock
from testproject.demo import probes

prefix, count, lead_ms, spread_ms = sys.argv[1], *map(int, sys.argv[2:5])
first = current_clock().now_ms() + lead_ms
durable.schedule_many(
    {
        "fn": probes.record,
        "args": [f"{prefix}{i}"],
        "at": datetime.fromtimestamp((first + i * spread_ms // count) / 1000, tz=UTC),
    }
    for i in range(count)
)
"""


@pytest.fixture
def cluster_workers(pg_cluster: TemporaryCluster, tmp_path: Path) -> Iterator[WorkerPool]:
    """Workers on a migrated database of the throwaway cluster, stopped before it goes."""
    url = pg_cluster.create_database(DBNAME)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    pool = WorkerPool(database_url=url, log_dir=log_dir)
    migrate = [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"]
    done = subprocess.run(
        migrate, cwd=REPO_ROOT, env=pool.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"migrate failed:\n{done.stdout}\n{done.stderr}"
    try:
        yield pool
    finally:
        pool.stop_all()


class Restarts:
    """Reads the throwaway database, and restarts the worker if it dies (as systemd would).

    The restart keeps the test going so that "nothing lost, nothing doubled" is still
    checked; the test fails at the end if the worker ever died.
    """

    def __init__(self, cluster: TemporaryCluster, pool: WorkerPool) -> None:
        self.cluster = cluster
        self.pool = pool
        self.deaths: list[str] = []

    def one(self, sql: str) -> object:
        try:
            return self.cluster.query(DBNAME, sql)[0][0]
        except Exception:  # down or starting: not yet
            return None

    def fired(self, prefix: str) -> int:
        return self.one(f"SELECT count(*) FROM demo_firerecord WHERE key LIKE '{prefix}%'") or 0

    def schedule(self, prefix: str, count: int, lead_ms: int, spread_ms: int) -> None:
        args = [prefix, str(count), str(lead_ms), str(spread_ms)]
        done = subprocess.run(
            [sys.executable, "-c", SCHEDULE, *args],
            cwd=REPO_ROOT,
            env=self.pool.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr

    def wait_fired(self, prefix: str, at_least: int, timeout_s: float) -> float:
        def check() -> bool:
            worker = self.pool.workers["r1"]
            if not worker.alive:
                tail = "\n".join(worker.log().splitlines()[-15:])
                self.deaths.append(f"exit {worker.proc.returncode}:\n{tail}")
                self.pool.start("r1")
            return self.fired(prefix) >= at_least

        return self.pool.wait_until(
            check,
            timeout_s=timeout_s,
            what=f"{at_least} {prefix!r} timers fired",
            explain=lambda: self.cluster.server_log()[-2000:],
        )


def test_database_restart_mid_run(pg_cluster, cluster_workers, record_property):
    """Two restarts: one while the worker fires a burst, one while it waits for work.

    Nothing lost, doubled or early is asserted whatever happens, and the worker must
    survive both restarts (it is restarted if it dies, so the invariants are still checked).
    """
    pool, db = cluster_workers, Restarts(pg_cluster, cluster_workers)
    pool.start("r1")
    pool.wait_until(
        lambda: db.one("SELECT count(*) FROM durable_shardlease WHERE owner = 'r1'") == SHARDS,
        timeout_s=30,
        what="r1 holding every shard",
        require_alive=["r1"],
    )
    busy, idle = 2_000, 500
    db.schedule("busy", busy, lead_ms=2_000, spread_ms=6_000)
    db.wait_fired("busy", busy * 3 // 10, timeout_s=30)
    down_ms = now_ms()
    pg_cluster.restart(pause_s=2.0)
    up_ms = now_ms()
    assert db.fired("busy") < busy, "the burst was over before the restart: nothing was tested"
    took = db.wait_fired("busy", busy, timeout_s=60)
    metric(record_property, "busy_restart_outage_s", (up_ms - down_ms) / 1000)
    metric(record_property, "busy_all_fired_after_db_up_s", round(took, 2))

    # Now the worker is idle, waiting for work on its LISTEN connection.
    db.schedule("idle", idle, lead_ms=500, spread_ms=4_000)
    pg_cluster.restart(pause_s=2.0)
    took = db.wait_fired("idle", idle, timeout_s=60)
    metric(record_property, "idle_all_fired_after_db_up_s", round(took, 2))

    dup = pg_cluster.query(
        DBNAME, "SELECT key, count(*) FROM demo_firerecord GROUP BY key HAVING count(*) > 1"
    )
    assert not dup, f"fired more than once: {dup[:10]}\n{pool.logs()}"
    keys = {k for (k,) in pg_cluster.query(DBNAME, "SELECT key FROM demo_firerecord")}
    expected = {f"busy{i}" for i in range(busy)} | {f"idle{i}" for i in range(idle)}
    assert keys == expected, f"lost: {sorted(expected - keys)[:10]}\n{pool.logs()}"
    assert db.one("SELECT count(*) FROM durable_timer WHERE state <> 'fired'") == 0
    early = pg_cluster.query(
        DBNAME,
        "SELECT key, fired_at_ms, due_at_ms FROM demo_firerecord "
        "WHERE fired_at_ms < due_at_ms LIMIT 10",
    )
    assert not early, f"fired early: {early}"
    after = db.one(f"SELECT count(*) FROM demo_firerecord WHERE fired_at_ms >= {up_ms}")
    assert after, "nothing fired after the database came back"
    unavailable = pool.workers["r1"].events("database.unavailable")
    assert unavailable, f"no database.unavailable logged\n{pool.logs()}"
    metric(record_property, "database_unavailable_lines", len(unavailable))
    deaths = "\n".join(db.deaths)
    assert not db.deaths, f"the worker died on a database restart:\n{deaths}"


@pytest.mark.django_db(transaction=True)
def test_lost_listen_session_does_not_kill_the_worker(workers):
    workers.start("l1")
    workers.wait_until(
        lambda: len(owned_by("l1")) == SHARDS, timeout_s=30, what="l1 holding every shard"
    )

    def terminate_listen_session() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND query LIKE 'LISTEN%%'",
                [app_name("l1")],
            )
            return cursor.fetchall() == [(True,)]

    workers.wait_until(terminate_listen_session, timeout_s=10, what="l1's LISTEN session")
    durable.schedule(probes.record, args=["after-drop"], delay=timedelta(milliseconds=500))
    workers.wait_until(
        lambda: fired_count("after-drop") == 1,
        timeout_s=10,
        what="a timer firing after the LISTEN session was dropped",
        require_alive=["l1"],
    )
    assert workers.workers["l1"].alive
