"""A PostgreSQL failover under load: the primary dies, its synchronous replica is promoted.

Two throwaway clusters (never the shared server): a primary and a streaming replica made
with ``pg_basebackup``, which the primary waits for at every commit
(``synchronous_standby_names``). Two workers and a scheduler (a steady stream of timers
and workflows, one commit each) connect with a multi-host URL (both servers,
``target_session_attrs=read-write``), so they find whichever one is the primary. The
primary is killed (``pg_ctl stop -m immediate``) and the replica promoted. Asserted: every
timer or workflow whose commit was acknowledged fires exactly once, none early (a commit
that failed without an answer fires at most once), the workers reconnect by themselves,
and the timers due while there was no primary fire within the promotion time + 5 s of
their time. The outage seen by fires (how late those timers fired) is printed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from durable.testing.cluster import TemporaryCluster
from tests.acceptance.helpers import REPO_ROOT, SHARDS, WorkerPool, metric, now_ms

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres]

DBNAME = "durable_failover"
STANDBY = "replica1"

# Run in a subprocess with the multi-host DATABASE_URL: one commit per timer or workflow,
# printing each key once its commit returned ("?key" when the commit raised: unknown).
STEADY = """
import os, sys, time
from datetime import timedelta

import django

django.setup()

from django.db import DatabaseError, connections, transaction

import durable
from testproject.demo import probes
from tests.acceptance import workflows as wf

stop, i = sys.argv[1], 0
while not os.path.exists(stop):
    i += 1
    key = f"w{i}" if i % 10 == 0 else f"t{i}"
    try:
        with transaction.atomic():
            if key.startswith("w"):
                wf.sleep_then_record.start(key, 1.0)
            else:
                delay = timedelta(milliseconds=300 + (i * 37) % 2_500)
                durable.schedule(probes.record, args=[key], delay=delay)
    except DatabaseError:
        print(f"?{key}", flush=True)
        connections.close_all()
        time.sleep(0.1)
        continue
    print(key, flush=True)
    time.sleep(0.01)
"""


class Topology:
    """The two servers, and queries on whichever is the primary now."""

    def __init__(self, primary: TemporaryCluster, replica: TemporaryCluster) -> None:
        self.primary = primary
        self.replica = replica
        self.url = (
            f"postgres://postgres@127.0.0.1:{primary.port},127.0.0.1:{replica.port}/"
            f"{DBNAME}?target_session_attrs=read-write&connect_timeout=3"
        )

    def rows(self, sql: str) -> list[tuple]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def one(self, sql: str) -> object:
        try:
            return self.rows(sql)[0][0]
        except psycopg.Error:  # no primary right now
            return None


@pytest.fixture
def topology(pg_cluster: TemporaryCluster, tmp_path: Path) -> Iterator[Topology]:
    """pg_cluster as the primary, a synchronous streaming replica of it, a migrated DB."""
    url = pg_cluster.create_database(DBNAME)
    env = WorkerPool(database_url=url, log_dir=tmp_path).env
    migrate = [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"]
    done = subprocess.run(
        migrate, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"migrate failed:\n{done.stdout}\n{done.stderr}"
    replica = TemporaryCluster()
    try:
        replica.start_standby_of(pg_cluster, STANDBY)
        pg_cluster.query("postgres", f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY}'")
        pg_cluster.query("postgres", "SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while pg_cluster.query("postgres", "SELECT sync_state FROM pg_stat_replication") != [
            ("sync",)
        ]:
            assert time.monotonic() < deadline, replica.server_log()[-2000:]
            time.sleep(0.1)
        yield Topology(pg_cluster, replica)
    finally:
        replica.destroy()


def test_failover_to_a_synchronous_replica_loses_and_doubles_nothing(
    topology: Topology, tmp_path: Path, record_property
):
    (tmp_path / "logs").mkdir()
    pool = WorkerPool(database_url=topology.url, log_dir=tmp_path / "logs")
    stop = tmp_path / "stop"
    out = (tmp_path / "steady.out").open("w")
    steady = None
    try:
        pool.start("w1")
        pool.start("w2")
        pool.wait_until(
            lambda: (
                topology.one(
                    "SELECT count(DISTINCT owner) FROM durable_shardlease WHERE owner <> ''"
                )
                == 2
                and topology.one("SELECT count(*) FROM durable_shardlease WHERE owner <> ''")
                == SHARDS
            ),
            timeout_s=60,
            what="w1 and w2 holding every shard",
            require_alive=["w1", "w2"],
        )
        began = time.monotonic()
        steady = subprocess.Popen(
            [sys.executable, "-c", STEADY, str(stop)],
            cwd=REPO_ROOT,
            env=pool.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        fired = "SELECT count(*) FROM demo_firerecord"
        pool.wait_until(
            lambda: (topology.one(fired) or 0) >= 100,
            timeout_s=60,
            what="100 fires before the kill",
            require_alive=["w1", "w2"],
        )
        killed_ms = now_ms()
        topology.primary.stop("immediate")
        topology.replica.promote()
        promoted_ms = now_ms()
        pool.wait_until(
            lambda: (
                (
                    topology.one(
                        f"SELECT count(*) FROM demo_firerecord WHERE fired_at_ms > {promoted_ms}"
                    )
                    or 0
                )
                >= 200
            ),
            timeout_s=60,
            what="200 fires after the promotion",
            require_alive=["w1", "w2"],
        )
        stop.touch()
        steady.wait(timeout=60)
        ran_s = time.monotonic() - began
        out.close()
        lines = (tmp_path / "steady.out").read_text().split()
        acked = {line for line in lines if not line.startswith("?")}
        unknown = {line[1:] for line in lines if line.startswith("?")}
        assert acked and all(k[0] in "tw" and k[1:].isdigit() for k in acked), lines[-20:]

        def all_fired() -> bool:
            keys = {k for (k,) in topology.rows("SELECT key FROM demo_firerecord")}
            return acked <= keys

        pool.wait_until(
            all_fired,
            timeout_s=60,
            what="every acknowledged timer and workflow fired",
            require_alive=["w1", "w2"],
        )
        rows = topology.rows("SELECT key, fired_at_ms, due_at_ms FROM demo_firerecord")
    finally:
        stop.touch()
        if steady is not None and steady.poll() is None:
            steady.kill()
            steady.wait(timeout=10)
        if not out.closed:
            out.close()
        pool.stop_all()

    keys = [key for key, _, _ in rows]
    doubled = sorted({k for k in keys if keys.count(k) > 1})
    assert not doubled, f"fired more than once: {doubled[:10]}\n{pool.logs()}"
    assert acked <= set(keys)
    stray = set(keys) - acked - unknown
    assert not stray, f"fired but never scheduled: {sorted(stray)[:10]}"
    early = [(k, f, d) for k, f, d in rows if d is not None and f < d]
    assert not early, f"fired early: {early[:10]}"
    # They reconnected by themselves: never restarted, alive through every wait above
    # (require_alive), and each saw the database go away.
    for name in ("w1", "w2"):
        assert pool.workers[name].events("database.unavailable"), pool.logs()

    # fired_at_ms is when a fire's batch started (a batch that began just before the kill
    # may commit on the replica after it was promoted), so the outage is read from the
    # timers due while there was no primary: how late they fired.
    outage = [(f - d) for _, f, d in rows if d is not None and killed_ms <= d <= promoted_ms]
    figures = {
        "promotion_s": (promoted_ms - killed_ms) / 1000,
        "timers_due_during_outage": len(outage),
        "max_lateness_of_those_s": max(outage, default=0) / 1000,
        "max_lateness_of_all_s": max((f - d) for _, f, d in rows if d is not None) / 1000,
        "acknowledged_commits": len(acked),
        "unanswered_commits": len(unknown),
        "unanswered_commits_that_fired": len(unknown & set(keys)),
        "steady_load_per_s": round(len(lines) / ran_s, 1),
    }
    for name in ("w1", "w2"):  # each failed turn logs one line, then backs off
        waits = [
            line.split("retry_in_s=")[1].split()[0]
            for line in pool.workers[name].events("database.unavailable")
        ]
        figures[f"{name}_backoffs_s"] = ",".join(waits)
    for name, value in figures.items():
        metric(record_property, f"failover_{name}", value)
    assert outage, "no timer came due during the outage: nothing was tested"
    assert max(outage) <= promoted_ms - killed_ms + 5_000, pool.logs()


# Run in a subprocess: schedule timers key0..key{n-1}, due from 2 s to 2 + n/20 s from now.
SCHEDULE = """
import sys
from datetime import timedelta

import django

django.setup()

from django.db import transaction

import durable
from testproject.demo import probes

n = int(sys.argv[1])
with transaction.atomic():
    for i in range(n):
        delay = timedelta(milliseconds=2_000 + i * 50)
        durable.schedule(probes.record, args=[f"key{i}"], delay=delay)
print("scheduled", n, flush=True)
"""


def test_an_old_primary_that_comes_back_is_refused(
    topology: Topology, tmp_path: Path, record_property
):
    """The old primary restarts with its data and takes writes (a split brain the operator
    failed to fence) while its timers are still pending there. The worker, which has used
    the promoted replica's newer timeline, must not fire on it: the multi-host URL lists
    the old primary first, so every reconnect reaches it, and is refused
    (``database.stale_primary``). Once it is gone, the worker goes back to the new primary
    and every timer fires there exactly once."""
    (tmp_path / "logs").mkdir()
    pool = WorkerPool(database_url=topology.url, log_dir=tmp_path / "logs")
    timers = 400  # due over 2 s .. 22 s
    done = subprocess.run(
        [sys.executable, "-c", SCHEDULE, str(timers)],
        cwd=REPO_ROOT,
        env=pool.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    fired = "SELECT count(*) FROM demo_firerecord"
    try:
        pool.start("w1")
        pool.wait_until(
            lambda: (topology.one(fired) or 0) >= 20,
            timeout_s=60,
            what="20 fires on the first primary",
            require_alive=["w1"],
        )
        topology.primary.stop("immediate")
        topology.replica.promote()
        promoted_ms = now_ms()
        after = f"SELECT count(*) FROM demo_firerecord WHERE fired_at_ms > {promoted_ms}"
        pool.wait_until(
            lambda: (topology.one(after) or 0) >= 20,
            timeout_s=60,
            what="20 fires on the promoted replica",
            require_alive=["w1"],
        )
        # The old primary comes back as a primary, its timers pending, no longer waiting
        # for a synchronous standby (so its commits would succeed).
        topology.primary.start()
        topology.primary.query(DBNAME, "ALTER SYSTEM RESET synchronous_standby_names")
        topology.primary.query(DBNAME, "SELECT pg_reload_conf()")
        old_fired = topology.primary.query(DBNAME, fired)[0][0]
        old_pending = topology.primary.query(
            DBNAME, "SELECT count(*) FROM durable_timer WHERE state = 'pending'"
        )[0][0]
        assert old_pending > 0, "nothing pending on the old primary: nothing was tested"
        # Cut the worker's sessions on the new primary: it reconnects, and libpq tries
        # the old primary first.
        topology.replica.query(
            "postgres",
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{DBNAME}' AND pid <> pg_backend_pid()",
        )
        pool.wait_until(
            lambda: (
                len(pool.workers["w1"].events("database.stale_primary")) >= 2
                or topology.primary.query(DBNAME, fired)[0][0] > old_fired
            ),
            timeout_s=30,
            what="the worker refusing the old primary twice (or firing there)",
            require_alive=["w1"],
        )
        fired_on_old = topology.primary.query(DBNAME, fired)[0][0] - old_fired
        assert fired_on_old == 0, f"{fired_on_old} fired on the old primary\n{pool.logs()}"
        topology.primary.stop("immediate")
        ok = "SELECT count(DISTINCT key) FROM demo_firerecord WHERE key LIKE 'key%'"
        pool.wait_until(
            lambda: topology.one(ok) == timers,
            timeout_s=60,
            what="every timer fired on the new primary",
            require_alive=["w1"],
        )
        rows = topology.rows("SELECT key, fired_at_ms, due_at_ms FROM demo_firerecord")
    finally:
        pool.stop_all()
    keys = [key for key, _, _ in rows]
    assert len(keys) == len(set(keys)) == timers, "a timer fired twice or not at all"
    assert all(f >= d for _, f, d in rows), "a timer fired early"
    refused = pool.workers["w1"].events("database.stale_primary")
    metric(record_property, "old_primary_refusals", len(refused))
    metric(record_property, "old_primary_pending_timers_left_alone", old_pending)
