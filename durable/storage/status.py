"""Read-only overview queries for operators: the status command, the admin, metrics.

Kept cheap on big tables: counts go through the partial pending index or are grouped on
small tables (leases, nodes); nothing here counts the whole timer table.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import Count

from durable.conf import DurableSettings
from durable.models import ShardLease, Timer, TimerState, WorkerNode, WorkflowRun
from durable.storage import retention as retention_store
from durable.storage.leases import ms_to_dt


@dataclass(frozen=True, slots=True)
class ShardStatus:
    """One shard's lease and lag."""

    shard: int
    owner: str
    token: int
    expires_at: datetime | None
    cursor_ms: int
    lag_ms: int | None
    live: bool


def pending_by_shard(db: str) -> dict[int, int]:
    """Pending timers per shard (an index-only count over the pending partial index)."""
    rows = (
        Timer.objects.using(db)
        .filter(state=TimerState.PENDING)
        .values("shard")
        .annotate(n=Count("id"))
        .values_list("shard", "n")
    )
    return dict(rows)


def shards(db: str, now_ms: int, first: int = 0) -> list[ShardStatus]:
    """Every shard from ``first`` on with its owner, token and lag (now - cursor) when owned."""
    now = ms_to_dt(now_ms)
    out = []
    for lease in ShardLease.objects.using(db).filter(shard__gte=first).order_by("shard"):
        live = bool(lease.owner) and lease.expires_at is not None and lease.expires_at > now
        lag = now_ms - lease.cursor_ms if live and lease.cursor_ms else None
        out.append(
            ShardStatus(
                lease.shard, lease.owner, lease.token, lease.expires_at, lease.cursor_ms, lag, live
            )
        )
    return out


def nodes(db: str, now_ms: int, ttl_s: float) -> list[dict[str, Any]]:
    """Worker nodes, most recent heartbeat first, with a ``live`` flag."""
    since = ms_to_dt(now_ms) - timedelta(seconds=ttl_s)
    out = []
    for node in WorkerNode.objects.using(db).order_by("-heartbeat_at")[:100]:
        out.append(
            {
                "name": node.name,
                "host": node.host,
                "pid": node.pid,
                "heartbeat_at": node.heartbeat_at,
                "started_at": node.started_at,
                "live": node.stopped_at is None and node.heartbeat_at >= since,
                "shards": len(node.shards or []),
            }
        )
    return out


def failed_timers(db: str, limit: int = 20) -> tuple[int, list[Timer]]:
    """How many timers are dead-lettered, and the most recent ``limit`` of them."""
    qs = Timer.objects.using(db).filter(state=TimerState.FAILED)
    return qs.count(), list(qs.order_by("-updated_at")[:limit])


def recent_fires(db: str, now_ms: int, window_s: int = 60, sample: int = 5000) -> dict[str, Any]:
    """Fires in the last ``window_s`` seconds and their lateness (p50/p99/max, in ms).

    Counted through the index on finished rows' ``updated_at``; lateness is computed over
    the most recent ``sample`` fires so the cost stays bounded at high rates.
    """
    since = ms_to_dt(now_ms - window_s * 1000)
    qs = Timer.objects.using(db).filter(state=TimerState.FIRED, updated_at__gte=since)
    count = qs.count()
    rows = qs.order_by("-updated_at").values_list("fire_at_ms", "fired_at")[:sample]
    late = sorted(
        max(0, int(fired.timestamp() * 1000) - due) for due, fired in rows if fired is not None
    )

    def pct(p: float) -> int | None:
        return late[min(len(late) - 1, int(p * len(late)))] if late else None

    return {
        "window_s": window_s,
        "fired": count,
        "per_s": round(count / window_s, 1),
        "lateness_ms": {"p50": pct(0.50), "p99": pct(0.99), "max": late[-1] if late else None},
    }


def workflow_runs_by_state(db: str) -> dict[str, int]:
    """Workflow runs per state (grouped over the state index)."""
    rows = WorkflowRun.objects.using(db).values("state").annotate(n=Count("pk"))
    return dict(rows.values_list("state", "n"))


@dataclass(frozen=True, slots=True)
class OrphanedShard:
    """A shard at or above ``SHARDS`` that still holds work no worker will run."""

    shard: int
    pending: int = 0
    firing: int = 0
    runs: int = 0


def tables_exist(db: str) -> bool:
    """Whether the tables :func:`orphaned_shards` reads exist (no: not migrated yet)."""
    conn = connections[db]
    with conn.cursor() as cursor:
        names = set(conn.introspection.table_names(cursor))
    return {m._meta.db_table for m in (Timer, WorkflowRun, ShardLease)} <= names


def orphaned_shards(db: str, shard_count: int) -> list[OrphanedShard]:
    """Shards ``>= shard_count`` holding pending or firing timers or unfinished runs.

    Three grouped counts: pending and firing timers each through their partial index
    (shard is its first column), unfinished runs through the state index.
    """
    found: dict[int, dict[str, int]] = {}
    timers = Timer.objects.using(db).filter(shard__gte=shard_count)
    for state, name in ((TimerState.PENDING, "pending"), (TimerState.FIRING, "firing")):
        rows = timers.filter(state=state).values("shard").annotate(n=Count("id"))
        for shard, n in rows.values_list("shard", "n"):
            found.setdefault(shard, {})[name] = n
    runs = (
        WorkflowRun.objects.using(db)
        .filter(state__in=WorkflowRun.ACTIVE_STATES, shard__gte=shard_count)
        .values("shard")
        .annotate(n=Count("pk"))
    )
    for shard, n in runs.values_list("shard", "n"):
        found.setdefault(shard, {})["runs"] = n
    return [OrphanedShard(shard, **counts) for shard, counts in sorted(found.items())]


def leases_beyond(db: str, shard_count: int, now_ms: int) -> list[ShardStatus]:
    """Lease rows of shards ``>= shard_count`` (left by a larger ``SHARDS``)."""
    return shards(db, now_ms, first=shard_count)


@dataclass(frozen=True, slots=True)
class RetentionStatus:
    """One retention setting: what it prunes, after how many days (None: never), and how
    many rows are past it now (counted up to ``cap``)."""

    what: str
    setting: str
    days: float | None
    past: int
    cap: int


def retention(
    db: str, now_ms: int, conf: DurableSettings, cap: int = 1000
) -> list[RetentionStatus]:
    """The retention settings and the rows past each, each count stopping at ``cap``.

    The counts go through the indexes pruning uses (finished timers by ``updated_at``,
    finished top-level runs by ``finished_at``; failed timers are few).
    """
    kinds = (
        ("fired/cancelled timers", "RETENTION_DAYS", "timers"),
        ("failed timers", "FAILED_RETENTION_DAYS", "failed"),
        ("finished runs", "RUN_RETENTION_DAYS", "runs"),
    )
    out = []
    for label, key, what in kinds:
        days = getattr(conf, key)
        past = retention_store.past_retention(db, now_ms, days, what, cap=cap)
        out.append(RetentionStatus(label, key, days, past, cap))
    return out


def raft_view(db: str, now_ms: int, ttl_s: float) -> dict[int, dict[str, Any]]:
    """Per shard, the Raft groups as the live workers publish them (``WorkerNode.raft``):
    ``leader`` (the worker that says it leads, at the highest term), ``term`` and
    ``followers`` (workers that follow). Empty when no live worker runs Raft."""
    since = ms_to_dt(now_ms) - timedelta(seconds=ttl_s)
    live = WorkerNode.objects.using(db).filter(heartbeat_at__gte=since, stopped_at__isnull=True)
    out: dict[int, dict[str, Any]] = {}
    for name, view in live.values_list("name", "raft"):
        for key, row in (view or {}).items():
            shard = out.setdefault(int(key), {"leader": None, "term": 0, "followers": []})
            term = int(row.get("term") or 0)
            if row.get("role") == "leader" and term >= shard["term"]:
                shard["leader"], shard["term"] = name, term
            elif row.get("role") == "follower":
                shard["followers"].append(name)
            shard["term"] = max(shard["term"], term)
    for shard in out.values():
        shard["followers"].sort()
    return out
