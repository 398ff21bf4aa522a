"""Read-only queries of the admin's overview page, beyond those of ``durable_status``.

Each is bounded on big tables: counts stop at :data:`COUNT_LIMIT` rows (the caller shows
"more than"), lists are short and served by an index (``durable_wfrun_state_idx`` for
runs by state, the small schedule table for schedules).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connections
from django.db.models import Count

from durable.models import CronSchedule, ShardLease, Timer, TimerState, WorkflowRun, WorkflowState

#: Counts stop here: the overview shows "10,000+" past it (as the changelists do).
COUNT_LIMIT = 10_000

#: The per-shard pending counts share this budget, but each counts at least
#: :data:`MIN_SHARD_LIMIT` rows: with 64 shards each stops at 156, with 1,024 at 100.
MIN_SHARD_LIMIT = 100


@dataclass(frozen=True, slots=True)
class Attention:
    """Rows needing someone's attention: how many (capped) and the latest few."""

    count: int
    capped: bool
    latest: list[dict[str, object]]


def failed_timers(db: str, limit: int = 10) -> Attention:
    """Dead-lettered timers: a capped count and the ``limit`` latest due.

    Both are served by ``durable_timer_unfired_idx`` (state, fire_at_ms); ordering by
    when they failed instead would sort every failed row.
    """
    rows = Timer.objects.using(db).filter(state=TimerState.FAILED)
    count = rows[: COUNT_LIMIT + 1].count()
    fields = ("id", "target", "attempts", "last_error")
    latest = [
        {"id": pk, "target": target, "attempts": attempts, "error": error}
        for pk, target, attempts, error in rows.order_by("-fire_at_ms").values_list(*fields)[:limit]
    ]
    return Attention(min(count, COUNT_LIMIT), count > COUNT_LIMIT, latest)


@dataclass(frozen=True, slots=True)
class ShardPending:
    """Pending timers per shard, each count stopped at ``limit`` (then ``capped``)."""

    counts: dict[int, int]
    capped: frozenset[int]
    limit: int


def pending_by_shard(db: str, shard_count: int) -> ShardPending:
    """Pending timers of each shard that has a lease row, counted up to a limit each.

    One statement: per lease row, a count of at most ``limit + 1`` rows of the pending
    partial index (shard is its first column), so the cost is bounded by
    ``shards * limit`` index entries however many timers are pending. Django's ORM
    cannot express a sliced count per outer row, hence the SQL.
    """
    limit = max(MIN_SHARD_LIMIT, COUNT_LIMIT // max(1, shard_count))
    connection = connections[db]
    q = connection.ops.quote_name
    timer, lease = q(Timer._meta.db_table), q(ShardLease._meta.db_table)
    sql = (
        # The state is a literal, as in the partial index's predicate, so that a
        # server-side prepared plan could still use the index.
        f"SELECT l.{q('shard')}, (SELECT COUNT(*) FROM (SELECT 1 FROM {timer} t "
        f"WHERE t.{q('state')} = '{TimerState.PENDING.value}' "
        f"AND t.{q('shard')} = l.{q('shard')} LIMIT %s) AS p) FROM {lease} l"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [limit + 1])
        rows = cursor.fetchall()
    counts = {shard: min(n, limit) for shard, n in rows}
    capped = frozenset(shard for shard, n in rows if n > limit)
    return ShardPending(counts, capped, limit)


def failed_runs(db: str, limit: int = 10) -> Attention:
    """Failed workflow runs: a capped count and the most recent ``limit``."""
    rows = WorkflowRun.objects.using(db).filter(state=WorkflowState.FAILED)
    count = rows[: COUNT_LIMIT + 1].count()
    latest = rows.order_by("-updated_at").values("id", "name", "error", "updated_at")[:limit]
    return Attention(min(count, COUNT_LIMIT), count > COUNT_LIMIT, list(latest))


def stalled_runs(db: str, before: datetime, limit: int = 10) -> Attention:
    """Runs marked running whose row has not changed since ``before``.

    A replay updates its run at each checkpoint; one untouched for long is stuck in a
    step (or its worker died and the wake-up has not been re-fired yet).
    """
    rows = WorkflowRun.objects.using(db).filter(state=WorkflowState.RUNNING, updated_at__lt=before)
    count = rows[: COUNT_LIMIT + 1].count()
    latest = rows.order_by("updated_at").values("id", "name", "error", "updated_at")[:limit]
    return Attention(min(count, COUNT_LIMIT), count > COUNT_LIMIT, list(latest))


def failing_schedules(db: str, limit: int = 20) -> list[dict[str, object]]:
    """Enabled schedules whose last run failed or was interrupted."""
    rows = CronSchedule.objects.using(db).filter(
        enabled=True,
        last_status__in=[CronSchedule.Status.FAILED, CronSchedule.Status.INTERRUPTED],
    )
    fields = ("id", "name", "last_status", "last_error", "last_run_at")
    return list(rows.order_by("-last_run_at").values(*fields)[:limit])


def schedule_counts(db: str) -> dict[str, int]:
    """Schedules enabled and paused (a small table: a plain grouped count)."""
    rows = CronSchedule.objects.using(db).values("enabled").annotate(n=Count("id"))
    by_flag = {row["enabled"]: row["n"] for row in rows}
    return {"enabled": by_flag.get(True, 0), "paused": by_flag.get(False, 0)}
