"""One occurrence's run: call the schedule's function, record the outcome on its row.

Shared by both ways :mod:`durable.scheduling.occurrences` fires an occurrence (atomic,
in the worker's batch transaction; ``atomic=False``, outside any): build the
:class:`~durable.scheduling.cron.Occurrence` the function receives, call it (in a
savepoint of its own, or together with its batch), record the run's status, error and
duration on the ``CronSchedule`` row (:data:`RUN_FIELDS`), count skipped occurrences,
and log the ``cron.*`` events.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from durable.core.catchup import Decision, Run
from durable.core.errors import sanitize_error
from durable.core.timeutil import ms_to_datetime
from durable.dispatch.kinds import RedoCarefully
from durable.models import CronSchedule
from durable.scheduling.cron import Occurrence, schedule_function

log = logging.getLogger("durable.cron")

#: The ``CronSchedule`` fields a run writes.
RUN_FIELDS = (
    "last_scheduled_ms",
    "last_started_ms",
    "last_run_at",
    "last_duration_ms",
    "last_status",
    "last_error",
    "fired_count",
    "failed_count",
    "busy_since_ms",
)


def event(level: int, name: str, **fields: Any) -> None:
    """Log ``name key=value ...`` (the worker's structured-event format)."""
    if log.isEnabledFor(level):
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        log.log(level, "%s %s", name, text, extra={"durable": {"event": name, **fields}})


def occurrence_of(name: str, tz: str, run: Run, started_ms: int) -> Occurrence:
    """The :class:`Occurrence` a schedule's function receives for ``run``."""
    return Occurrence.build(
        name, tz, run.occurrence_ms, started_ms, catch_up=run.catch_up, missed=run.missed
    )


def run_function(
    db: str,
    path: str,
    occurrence: Occurrence,
    kwargs: dict[str, Any],
    *,
    atomic: bool,
    together: bool = False,
) -> tuple[str, str]:
    """Run ``fn(occurrence, **kwargs)``; return ``(status, sanitized error)``.

    Never raises, except with ``together`` (an atomic occurrence fired with its batch):
    then the function runs without a savepoint of its own, two round trips saved per
    occurrence, and a failure raises :class:`RedoCarefully`, so that the firer rolls the
    batch back and fires its occurrences again one by one, each in a savepoint, where
    this failure is recorded on the schedule as usual.
    """
    try:
        fn = schedule_function(path)  # a lookup: the path is row data, never imported
        if atomic and together:
            try:
                fn(occurrence, **kwargs)
            except Exception as exc:
                raise RedoCarefully(f"schedule {occurrence.schedule!r} failed") from exc
        elif atomic:
            with transaction.atomic(using=db):  # its own savepoint: a failure undoes only it
                fn(occurrence, **kwargs)
        else:
            fn(occurrence, **kwargs)
    except RedoCarefully:
        raise
    except Exception as exc:
        error = sanitize_error(exc)
        event(
            logging.WARNING,
            "cron.run_failed",
            schedule=occurrence.schedule,
            occurrence=occurrence.scheduled_ms,
            error=error,
        )
        return CronSchedule.Status.FAILED, error
    return CronSchedule.Status.SUCCEEDED, ""


def record_run(
    row: CronSchedule,
    run_ms: int,
    started_ms: int,
    status: str,
    error: str,
    duration: int | None,
) -> None:
    """Record one run's start, duration, status and error on the (locked) row."""
    row.last_scheduled_ms = run_ms
    row.last_started_ms = started_ms
    row.last_run_at = ms_to_datetime(started_ms)
    row.last_duration_ms = duration
    row.last_status = status
    row.last_error = error
    if status == CronSchedule.Status.SUCCEEDED:
        row.fired_count += 1
    else:
        row.failed_count += 1


def note_skips(row: CronSchedule, decision: Decision) -> None:
    """Count and log the occurrences ``decision`` skipped (missed, or overlapping)."""
    if not decision.skipped:
        return
    row.skipped_count += decision.skipped
    event(
        logging.WARNING if decision.reason == "missed" else logging.INFO,
        "cron.skipped",
        schedule=row.name,
        count=decision.skipped,
        reason=decision.reason,
        policy=row.catch_up if decision.reason == "missed" else row.overlap,
    )
