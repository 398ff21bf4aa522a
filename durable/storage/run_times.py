"""Read-only queries of a run's recorded times, for the admin's timeline.

A run records at most ``MAX_STEPS_PER_RUN`` calls (10,000 by default): its steps are
read in one query served by the ``(run, seq)`` unique index, without their results
(JSON of any size, which the timeline never draws). Signals are read newest first and
capped: a run can be sent any number of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connections, models

from durable.models import WorkflowRun, WorkflowSignal, WorkflowStep
from durable.storage.checkpoints import is_postgres

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class StepTimes:
    """What the timeline draws of one recorded ctx call; instants in epoch ms."""

    seq: int
    kind: str
    name: str
    status: str
    attempts: int
    wake_ms: int | None
    started_ms: int | None
    duration_ms: int | None
    created_ms: int
    updated_ms: int
    error: str


@dataclass(frozen=True, slots=True)
class SignalTimes:
    """A signal sent to a run: when it was sent and, if it was, consumed (and by which seq)."""

    id: int
    name: str
    created_at: datetime
    consumed_at: datetime | None
    consumed_seq: int | None


_COLUMNS = ("seq", "kind", "name", "status", "attempts", "wake_ms", "started_at", "duration_ms",
            "created_at", "updated_at", "error")  # fmt: skip
_TIMES = {6, 8, 9}  # the datetime columns, read as epoch ms
_SELECT = [f"floor(extract(epoch FROM {c}) * 1000)::bigint" if i in _TIMES else c
           for i, c in enumerate(_COLUMNS)]  # fmt: skip
_STEPS_SQL = f"SELECT {', '.join(_SELECT)} FROM durable_workflowstep WHERE run_id = %s ORDER BY seq"
_MS = timedelta(milliseconds=1)


def step_times(db: str, run_id: str) -> list[StepTimes]:
    """The run's recorded calls in seq order (no results).

    PostgreSQL turns the timestamps into epoch ms itself: building 30,000 aware
    datetimes for a run of 10,000 steps took most of the page's time.
    """
    if is_postgres(db):
        with connections[db].cursor() as cursor:
            cursor.execute(_STEPS_SQL, [run_id])
            return [StepTimes(*row) for row in cursor.fetchall()]
    rows = WorkflowStep.objects.using(db).filter(run_id=run_id).order_by("seq")
    return [
        StepTimes(*(epoch_ms(v) if i in _TIMES else v for i, v in enumerate(row)))
        for row in rows.values_list(*_COLUMNS)
    ]


def epoch_ms(when: datetime | None) -> int | None:
    """An aware datetime as epoch ms, rounded down as PostgreSQL's query does (None: None)."""
    return None if when is None else (when - EPOCH) // _MS


def signal_times(db: str, run_id: str, limit: int) -> tuple[list[SignalTimes], int]:
    """The run's latest ``limit`` signals, oldest first, and how many it has in all."""
    rows = WorkflowSignal.objects.using(db).filter(run_id=run_id)
    latest = rows.order_by("-id").values_list(
        "id", "name", "created_at", "consumed_at", "consumed_seq"
    )[:limit]
    signals = [SignalTimes(*row) for row in reversed(latest)]
    total = len(signals) if len(signals) < limit else rows.count()
    return signals, total


def runs_bound_to(obj: models.Model, limit: int) -> tuple[list[WorkflowRun], int]:
    """The latest ``limit`` runs bound to ``obj`` (``runs().for_object(obj)``), newest
    first, and how many there are in all (the ``(model_label, object_pk)`` index)."""
    db = obj._state.db or "default"
    rows = WorkflowRun.objects.using(db).for_object(obj)
    latest = list(rows.order_by("-created_at", "-pk")[:limit])
    total = len(latest) if len(latest) < limit else rows.count()
    return latest, total
