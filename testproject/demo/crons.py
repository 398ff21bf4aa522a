"""Schedule handlers the demo and the tests run. Each writes ``FireRecord`` rows.

Nothing here is declared with ``@durable.cron``: this module is auto-imported (every
app's ``crons`` module is), and a declared schedule would be synced into every test
database a worker starts on. Tests create schedules with ``durable.schedules.create``
or pass declarations to ``sync_declared`` explicitly; ``@durable.handler`` registers the
functions, so that schedules created at run time may name them.

A record's key is ``<schedule>:<scheduled_ms>`` plus ``:catch_up`` for catch-up runs;
``due_at_ms`` is the occurrence, so counting rows per ``due_at_ms`` finds duplicates.
"""

from __future__ import annotations

import time

import durable
from durable.core.clock import current_clock
from durable.core.timeutil import datetime_to_ms
from durable.scheduling.cron import Occurrence
from testproject.demo.models import FireRecord


def _key(occurrence: Occurrence) -> str:
    suffix = ":catch_up" if occurrence.catch_up else ""
    return f"{occurrence.schedule}:{occurrence.scheduled_ms}{suffix}"


@durable.handler
def record(occurrence: Occurrence) -> None:
    """Write one row for the occurrence (atomic schedules: exactly once)."""
    FireRecord.objects.create(
        key=_key(occurrence),
        fired_at_ms=datetime_to_ms(occurrence.fired_at),
        due_at_ms=occurrence.scheduled_ms,
    )


@durable.handler
def fail(occurrence: Occurrence) -> None:
    """Write a row, then raise: the row rolls back and the error is recorded."""
    record(occurrence)
    raise RuntimeError(f"planned failure in /srv/app/secret/jobs.py at {occurrence.scheduled_ms}")


@durable.handler
def slow(occurrence: Occurrence) -> None:
    """Record, then take ``<n>`` ms, ``n`` being the end of the schedule's name (``x-2500``).

    Under a manual clock (tests) the clock is moved instead of sleeping, so a run "takes"
    that long without the test waiting.
    """
    record(occurrence)
    duration_ms = int(occurrence.schedule.rsplit("-", 1)[1])
    clock = current_clock()
    advance = getattr(clock, "advance", None)
    if advance is not None:
        advance(duration_ms)
    else:
        time.sleep(duration_ms / 1000)
