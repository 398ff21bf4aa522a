"""Three real workers with Raft on (64 shards, default settings but ``RAFT``), on loopback.

Issue 17's failure matrix, scaled to run in under a minute each (the full sizes are for
the bench): SIGKILL of the owner, SIGSTOP of an owner, two of three killed (lease
fallback), a full restart, and a node with the wrong password. Every test checks the
database's side: nothing lost, nothing doubled (exactly one ledger row per key), nothing
early, and nothing committed under a token its node no longer held.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import connection

import durable
from durable.models import ShardLease, Timer, WorkerNode
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.acceptance import workflows as wf
from tests.acceptance.helpers import (
    LEASE_TTL_S,
    SHARDS,
    WorkerPool,
    assert_exactly_once,
    database_url,
    fired_count,
    metric,
    now_ms,
    owned_by,
    progress,
)
from tests.acceptance.raft_cluster import check_timing

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]

NODES = ("r1", "r2", "r3")
PASSWORD = "raft-acceptance"


class RaftCluster:
    """Three workers sharing one ``DURABLE["RAFT"]``; each names itself with --raft-self."""

    def __init__(self, pool: WorkerPool, base: int) -> None:
        self.pool = pool
        self.addr = {name: f"127.0.0.1:{base + 100 * i}" for i, name in enumerate(NODES)}

    def start(self, name: str, *, password: str | None = None) -> None:
        raft = {
            "SELF": self.addr[NODES[0]],
            "PEERS": [self.addr[n] for n in NODES[1:]],
            "PASSWORD": password or PASSWORD,
        }
        self.pool.env["DURABLE_RAFT"] = json.dumps(raft)
        self.pool.start(name, "--raft-self", self.addr[name])

    def leaders(self) -> dict[str, int]:
        """Node name → shards it holds as a Raft leader's lease (raft_term > 0)."""
        out: dict[str, int] = {}
        for owner in ShardLease.objects.filter(raft_term__gt=0).values_list("owner", flat=True):
            out[owner] = out.get(owner, 0) + 1
        return out

    def settled(self) -> bool:
        """Every shard held by a running node that (by its last heartbeat) leads it."""
        alive = {n for n, w in self.pool.workers.items() if w.alive}
        views = dict(WorkerNode.objects.filter(name__in=alive).values_list("name", "raft"))
        rows = ShardLease.objects.values_list("shard", "owner")
        return all(
            owner in alive and views[owner].get(str(shard), {}).get("role") == "leader"
            for shard, owner in rows
        )


@pytest.fixture
def cluster(transactional_db, durable_settings, tmp_path: Path) -> Iterator[RaftCluster]:
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    # Default settings (no test tuning) except RAFT.
    pool = WorkerPool(
        database_url=database_url(connection.settings_dict), log_dir=log_dir, defaults=True
    )
    # Base ports apart from other test runs on this machine (shard s: base + s).
    base = random.randrange(20_000, 32_000, 400)  # below the ephemeral ports (32768+)
    try:
        yield RaftCluster(pool, base)
    finally:
        pool.stop_all()


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def start_all(cluster: RaftCluster) -> None:
    for name in NODES:
        cluster.start(name)
    cluster.pool.wait_until(
        cluster.settled, timeout_s=45, what="every shard held by a Raft leader", require_alive=NODES
    )


def schedule(prefix: str, count: int, first_ms: int, spread_ms: int, far: int = 0) -> list[str]:
    """``count`` probes due from ``first_ms`` over ``spread_ms``, and ``far`` due in an hour."""
    keys = [f"{prefix}{i}" for i in range(count)]
    durable.schedule_many(
        {"fn": probes.record, "args": [k], "at": at(first_ms + i * spread_ms // count)}
        for i, k in enumerate(keys)
    )
    if far:
        later = now_ms() + 3_600_000
        durable.schedule_many(
            {"fn": probes.record, "args": [f"far{i}"], "at": at(later + i)} for i in range(far)
        )
    return keys


def worst_lateness_after(prefix: str, since_ms: int) -> int:
    """Worst ``fired - max(due, since)`` of the prefix's records due before they fired."""
    rows = FireRecord.objects.filter(key__startswith=prefix).values_list("fired_at_ms", "due_at_ms")
    return max((f - max(d or 0, since_ms) for f, d in rows), default=0)


def test_sigkill_of_the_owner_fires_every_overdue_timer_within_2s(cluster, record_property):
    start_all(cluster)
    # 20,000 pending: 2,000 due over the next 8 s (the kill lands among them), the rest
    # in an hour; 40 workflow runs asleep across the kill.
    first = now_ms() + 3_000
    keys = schedule("k", 2_000, first, 8_000, far=18_000)
    runs = [wf.sleep_then_record.start(f"wf{i}", 3 + (i % 5) * 0.5) for i in range(40)]
    cluster.pool.wait_until(
        lambda: fired_count("k") >= 600, timeout_s=30, what="a part fired", require_alive=NODES
    )
    # The victim is chosen at the kill: ownership may still have moved since start-up.
    victim = max(NODES, key=lambda n: len(owned_by(n)))
    held = len(owned_by(victim))
    assert held, f"no node holds a shard\n{cluster.pool.logs()}"
    cluster.pool.workers[victim].kill()
    killed = now_ms()
    metric(record_property, "victim_shards", held)
    metric(record_property, "killed_at_ms", killed)
    survivors = [n for n in NODES if n != victim]
    cluster.pool.wait_until(
        lambda: not owned_by(victim),
        timeout_s=LEASE_TTL_S,
        what="the victim's shards taken over",
        require_alive=survivors,
    )
    metric(record_property, "shards_moved_after_kill_ms", now_ms() - killed)
    cluster.pool.wait_until(
        lambda: fired_count("k") >= len(keys) and fired_count("wf") >= len(runs),
        timeout_s=40,
        what="every due timer and run fired",
        require_alive=survivors,
        explain=lambda: progress("k"),
    )
    assert_exactly_once(keys, "k", cluster.pool)
    assert_exactly_once((f"wf{i}" for i in range(len(runs))), "wf", cluster.pool)
    worst_timer = worst_lateness_after("k", killed)
    worst_run = worst_lateness_after("wf", killed)
    metric(record_property, "worst_timer_after_kill_ms", worst_timer)
    metric(record_property, "worst_run_after_kill_ms", worst_run)
    assert Timer.objects.filter(state="pending").count() == 18_000  # the far ones
    late = sorted(
        (f - max(d or 0, killed), key, f - killed)
        for key, f, d in FireRecord.objects.filter(key__startswith="k").values_list(
            "key", "fired_at_ms", "due_at_ms"
        )
    )[-5:]
    shards = {
        t.args[0]: (t.shard, t.fired_token)
        for t in Timer.objects.filter(args__0__in=[k for _, k, _ in late])
    }
    detail = [(lateness, key, after, shards.get(key)) for lateness, key, after in late]
    metric(record_property, "latest_timers", detail)
    check_timing("worst overdue timer after the kill", worst_timer, 2_000)
    check_timing("worst workflow run resumed after the kill", worst_run, 2_000)


def test_sigstop_moves_shards_and_the_frozen_owner_commits_nothing(cluster, record_property):
    start_all(cluster)
    victim = max(NODES, key=lambda n: len(owned_by(n)))
    keys = schedule("s", 1_500, now_ms() + 2_000, 9_000)
    cluster.pool.wait_until(
        lambda: fired_count("s") >= 200, timeout_s=30, what="a part fired", require_alive=NODES
    )
    tokens = dict(ShardLease.objects.filter(owner=victim).values_list("shard", "token"))
    assert tokens, "the victim held nothing"
    cluster.pool.workers[victim].send(signal.SIGSTOP)
    stopped = now_ms()
    # The deadline that always holds: a frozen owner's open transaction keeps its lease
    # rows locked until PostgreSQL ends it (idle guard: 2 x LEASE_TTL_S); the 2 s target
    # is checked below.
    moved = cluster.pool.wait_until(
        lambda: not owned_by(victim),
        timeout_s=2 * LEASE_TTL_S + 10,
        what="shards moved off the frozen node",
    )
    metric(record_property, "shards_moved_after_sigstop_ms", int(moved * 1000))
    time.sleep(max(0.0, 5 - (now_ms() - stopped) / 1000))  # frozen for 5 s at least
    cluster.pool.workers[victim].send(signal.SIGCONT)
    cluster.pool.wait_until(
        lambda: fired_count("s") >= len(keys),
        timeout_s=40,
        what="every timer fired",
        explain=lambda: progress("s"),
    )
    time.sleep(1)  # let the resumed node run a few turns
    assert_exactly_once(keys, "s", cluster.pool)
    stale = [
        (s, t)
        for s, t in tokens.items()
        if Timer.objects.filter(shard=s, fired_token=t, fired_at__gt=at(stopped)).exists()
    ]
    assert not stale, f"committed under old tokens after the freeze: {stale}"
    check_timing("shards moved after SIGSTOP", moved * 1000, 2_000)


def test_two_of_three_killed_the_survivor_takes_all_by_lease_expiry(cluster, record_property):
    start_all(cluster)
    keys = schedule("t", 1_000, now_ms() + 2_000, 6_000)
    cluster.pool.wait_until(lambda: fired_count("t") >= 100, timeout_s=30, what="a part fired")
    survivor, *dead = NODES
    for name in dead:
        cluster.pool.workers[name].kill()
    killed = time.monotonic()
    took = cluster.pool.wait_until(
        lambda: len(owned_by(survivor)) == SHARDS,
        timeout_s=LEASE_TTL_S + 10,
        what="the survivor holding every shard",
        require_alive=[survivor],
    )
    metric(record_property, "survivor_took_all_s", round(took, 2))
    cluster.pool.wait_until(
        lambda: fired_count("t") >= len(keys), timeout_s=30, what="every timer fired"
    )
    metric(record_property, "all_fired_after_kill_s", round(time.monotonic() - killed, 2))
    assert_exactly_once(keys, "t", cluster.pool)
    check_timing("survivor took every shard", took * 1000, (LEASE_TTL_S + 2) * 1000)


def test_full_restart_fires_everything_from_the_rows(cluster, record_property):
    start_all(cluster)
    keys = schedule("f", 1_000, now_ms() + 2_000, 8_000)
    cluster.pool.wait_until(lambda: fired_count("f") >= 100, timeout_s=30, what="a part fired")
    for name in NODES:
        cluster.pool.workers[name].kill()
    before = fired_count("f")
    for name in NODES:
        cluster.start(name)
    cluster.pool.wait_until(
        lambda: fired_count("f") >= len(keys),
        timeout_s=LEASE_TTL_S + 60,
        what="every timer fired after the restart",
        explain=lambda: progress("f"),
    )
    metric(record_property, "fired_before_restart", before)
    assert_exactly_once(keys, "f", cluster.pool)
    cluster.pool.wait_until(cluster.settled, timeout_s=30, what="Raft leaders again")


def test_a_node_with_the_wrong_password_is_refused_and_injects_nothing(cluster):
    cluster.start("r1")
    cluster.start("r2")
    cluster.start("r3", password="not-the-password")
    pool = cluster.pool
    pool.wait_until(
        lambda: (
            all(
                owner in ("r1", "r2")
                for owner in ShardLease.objects.values_list("owner", flat=True)
            )
            and cluster.settled()
        ),
        timeout_s=45,
        what="r1 and r2 holding every shard as Raft leaders",
    )
    pool.wait_until(
        lambda: (
            pool.workers["r1"].events("raft.peer_refused")
            and pool.workers["r2"].events("raft.peer_refused")
        ),
        timeout_s=45,
        what="r1 and r2 logging the refused peer",
    )
    # r3 never heard from a leader: its published view knows none in any group, and no
    # good node ever saw r3 as a leader.
    pool.wait_until(
        lambda: WorkerNode.objects.filter(name="r3").exclude(raft={}).exists(),
        timeout_s=20,
        what="r3's heartbeat",
    )
    view = WorkerNode.objects.get(name="r3").raft
    assert all(row["leader"] in ("", cluster.addr["r3"]) for row in view.values()), view
    for name in ("r1", "r2"):
        leaders = {row["leader"] for row in WorkerNode.objects.get(name=name).raft.values()}
        assert cluster.addr["r3"] not in leaders
