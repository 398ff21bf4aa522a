"""Queries of :func:`durable.testing.time_machine`: what is due next, what fired, what ended.

A test that travels through time asks the database, not the wheel, what is due: the
rows are the truth the engine fires from, and a timer a handler scheduled a moment ago
is a row before it is in any wheel. Read-only; each runs in the caller's transaction.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db.models import Min

from durable.choices import TimerState
from durable.models import Timer, WorkflowRun

DUE_FIELDS = ("id", "shard", "kind", "target", "key", "fire_at_ms", "attempts")


def next_due_ms(db: str, after_ms: int, until_ms: int) -> int | None:
    """The earliest ``fire_at_ms`` of a pending timer after ``after_ms``, up to ``until_ms``."""
    rows = Timer.objects.using(db).filter(
        state=TimerState.PENDING, fire_at_ms__gt=after_ms, fire_at_ms__lte=until_ms
    )
    value = rows.aggregate(first=Min("fire_at_ms"))["first"]
    return None if value is None else int(value)


def due_timers(db: str, now_ms: int) -> list[dict[str, Any]]:
    """The pending timers due at ``now_ms`` (fields :data:`DUE_FIELDS`), oldest first."""
    rows = Timer.objects.using(db).filter(state=TimerState.PENDING, fire_at_ms__lte=now_ms)
    return list(rows.order_by("fire_at_ms", "id").values(*DUE_FIELDS))


def timer_outcomes(db: str, ids: Iterable[int]) -> dict[int, dict[str, Any]]:
    """State, attempts, fire time and last error of the timers ``ids``, by id."""
    fields = ("id", "state", "attempts", "fire_at_ms", "last_error")
    rows = Timer.objects.using(db).filter(id__in=list(ids)).values(*fields)
    return {int(row["id"]): row for row in rows}


def run_states(db: str, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Name, state, result and error of the runs ``ids``, by id."""
    fields = ("id", "name", "state", "result", "error")
    rows = WorkflowRun.objects.using(db).filter(id__in=list(ids)).values(*fields)
    return {str(row["id"]): row for row in rows}
