"""Read-only queries of the admin's overview page, beyond those of ``durable_status``.

Each is bounded on big tables: counts stop at :data:`COUNT_LIMIT` rows (the caller shows
"more than"), lists are short and served by an index (``durable_wfrun_state_idx`` for
runs by state, the small schedule table for schedules).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count

from durable.models import CronSchedule, WorkflowRun, WorkflowState

COUNT_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class Attention:
    """Rows needing someone's attention: how many (capped) and the latest few."""

    count: int
    capped: bool
    latest: list[dict[str, object]]


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
