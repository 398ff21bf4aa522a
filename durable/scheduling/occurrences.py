"""Firing an occurrence: the ``cron`` timer kind, registered with the worker's firer.

The firer resolves a ``cron`` timer's target (the schedule's name) through
:func:`resolve` and calls the returned function with the timer's kwargs
(``scheduled_ms``, and for a decided ``fire_all`` backlog ``catch_up``/``until_ms``);
that function calls the schedule's own ``fn(occurrence, **schedule.kwargs)``.

- **Atomic** schedules (the default) fire inside the worker's fenced batch transaction:
  lock the ``CronSchedule`` row, decide (:func:`durable.core.catchup.decide`), run the
  handler in a savepoint, record the run, insert the next occurrence's timer. One
  commit covers all of it, so the chain cannot break or fork, and a run's effect on the
  database happens exactly once. The occurrences of one batch share the locked read of
  their rows and the writes (:mod:`durable.scheduling.together`).
- **atomic=False** schedules run outside any transaction, at least once: a first
  transaction decides and sets a *running* marker, the handler runs, a second
  transaction records the run and inserts the next timer. The worker's claim on the
  occurrence timer covers a crash in between: when the claim expires
  (``CLAIM_TIMEOUT_S``) the timer fires again, finds its own marker and runs the
  occurrence again. The next timer only exists once the run is over, so occurrences due
  meanwhile are judged as overlapped: two runs never overlap (unless one outlives its
  claim, as for any ``atomic=False`` handler).

A handler that raises does not fail the timer: the error is recorded on the schedule
(sanitized), its writes roll back, and the next occurrence runs as planned.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

from django.db import transaction

from durable.conf import get_settings
from durable.core.catchup import Decision, Run, decide
from durable.core.clock import current_clock
from durable.dispatch.context import current_fire
from durable.dispatch.kinds import (
    FiringBatch,
    register_batch_scope,
    register_kind,
)
from durable.dispatch.registry import HandlerSpec
from durable.models import CronSchedule, TimerState
from durable.scheduling import together

# Calling the function and recording the run on the row: durable.scheduling.occurrence_runs.
from durable.scheduling.occurrence_runs import (
    RUN_FIELDS,
    event,
    note_skips,
    occurrence_of,
    record_run,
    run_function,
)
from durable.scheduling.specs import row_spec
from durable.storage import schedules as store

CHAIN_FIELDS = ("next_ms", "skipped_count", "running", "running_until_ms")


# Schedule name -> atomic, as last read by this process. The resolver runs for every
# fire, before the row is locked; a query there would cost a round trip per occurrence.
# A change of mode made elsewhere is caught when the fire locks the row (ModeChanged).
_modes: dict[str, bool] = {}


class ModeChanged(Exception):
    """The schedule's ``atomic`` flag changed since this process last read it.

    Raised before anything runs; the firer retries the timer a moment later and the
    resolver then picks the right path.
    """


def resolve(name: str) -> HandlerSpec:
    """The ``cron`` kind's resolver: how to fire an occurrence of schedule ``name``."""
    atomic = _modes.get(name)
    if atomic is None:
        atomic = store.is_atomic(get_settings().DATABASE, name)
        if atomic is not None:
            _modes[name] = atomic
    if atomic is False:
        return HandlerSpec(name=f"cron:{name}", fn=partial(fire_external, name), atomic=False)
    # A deleted schedule (None) fires as a no-op inside the batch, which marks it fired.
    return HandlerSpec(name=f"cron:{name}", fn=partial(fire_atomic, name), atomic=True)


def forget_mode(name: str) -> None:
    """Drop this process's cached ``atomic`` flag of ``name`` (after a change or delete)."""
    _modes.pop(name, None)


def _check_mode(row: CronSchedule, atomic: bool) -> None:
    if row.atomic != atomic:
        _modes[row.name] = row.atomic
        raise ModeChanged(f"schedule {row.name!r} is now atomic={row.atomic}; retrying")


register_kind("cron", resolve)


def _now() -> int:
    ctx = current_fire()
    return ctx.fired_ms if ctx is not None else current_clock().now_ms()


def _live(row: CronSchedule | None, scheduled_ms: int) -> bool:
    # Only the timer of the occurrence the row names is live; any other (cancelled by a
    # change that raced its fire, left over from before a pause) does nothing.
    return row is not None and row.enabled and row.running is None and row.next_ms == scheduled_ms


def _decide(row: CronSchedule, scheduled_ms: int, now_ms: int, backlog: dict[str, Any]) -> Decision:
    spec = row_spec(row)
    busy_until = None
    if row.last_started_ms is not None and row.last_duration_ms is not None:
        busy_until = row.last_started_ms + row.last_duration_ms
    return decide(
        spec.recurrence(),
        spec.policy(),
        scheduled_ms=scheduled_ms,
        now_ms=now_ms,
        until_ms=backlog.get("until_ms"),
        then_ms=backlog.get("then_ms"),
        busy_since_ms=row.busy_since_ms,
        busy_until_ms=busy_until,
    )


def _backlog_of(catch_up: bool | None, until_ms: int | None, then_ms: int | None) -> dict[str, Any]:
    # Only a timer of a decided fire_all backlog carries catch_up=True.
    return {"until_ms": until_ms, "then_ms": then_ms} if catch_up else {}


def fire_atomic(
    name: str,
    *,
    scheduled_ms: int,
    catch_up: bool | None = None,
    until_ms: int | None = None,
    then_ms: int | None = None,
) -> dict[str, Any]:
    """Fire occurrence ``scheduled_ms`` of an atomic schedule, in the caller's transaction."""
    db = get_settings().DATABASE
    now = _now()
    batch = together.current()
    row = batch.locked(name) if batch is not None else None
    if row is None:  # not fired with its batch (or a schedule created since): one by one
        batch = None
        row = store.lock(db, name)
    if row is None or not _live(row, scheduled_ms):
        event(logging.DEBUG, "cron.stale", schedule=name, scheduled_ms=scheduled_ms)
        return {"stale": True}
    _check_mode(row, atomic=True)
    decision = _decide(row, scheduled_ms, now, _backlog_of(catch_up, until_ms, then_ms))
    note_skips(row, decision)
    if not decision.backlog and decision.runs:
        row.busy_since_ms = now
    elapsed = 0
    for run in decision.runs:
        # Durations by the clock's own difference: the fire time (``now``) comes from
        # the worker's database-corrected clock, which a handler cannot read.
        occurrence = occurrence_of(row.name, row.timezone, run, now + elapsed)
        started = current_clock().now_ms()
        status, error = run_function(
            db, row.handler, occurrence, row.kwargs, atomic=True, together=batch is not None
        )
        duration = max(0, current_clock().now_ms() - started)
        record_run(row, run.occurrence_ms, now + elapsed, status, error, duration)
        elapsed += duration
    if batch is not None:
        row.next_ms = decision.next_ms
        batch.insert_later(
            row, store.occurrence_timer(name, decision.next_ms, **_next_backlog(decision))
        )
        batch.save_later(row)
    else:
        _advance(db, row, decision.next_ms, now, _next_backlog(decision))
        store.save(db, row, RUN_FIELDS + CHAIN_FIELDS)
    return {"ran": [run.occurrence_ms for run in decision.runs], "next_ms": row.next_ms}


def _next_backlog(decision: Decision) -> dict[str, Any]:
    if not decision.next_catch_up:
        return {}
    return {"catch_up": True, "until_ms": decision.until_ms, "then_ms": decision.then_ms}


def fire_external(
    name: str,
    *,
    scheduled_ms: int,
    catch_up: bool | None = None,
    until_ms: int | None = None,
    then_ms: int | None = None,
) -> dict[str, Any]:
    """Fire occurrence ``scheduled_ms`` of an ``atomic=False`` schedule (see the module doc)."""
    db = get_settings().DATABASE
    now = _now()
    with transaction.atomic(using=db):
        plan = _start_external(
            db, name, scheduled_ms, now, _backlog_of(catch_up, until_ms, then_ms)
        )
    if plan is None:
        return {"ran": []}
    results = []
    elapsed = 0
    for occurrence_ms, run_catch_up, missed in plan["runs"]:
        run = Run(occurrence_ms, run_catch_up, missed)
        occurrence = occurrence_of(name, plan["tz"], run, now + elapsed)
        started = current_clock().now_ms()
        # Plans recorded before schedules had kwargs have none.
        status, error = run_function(
            db, plan["handler"], occurrence, plan.get("kwargs", {}), atomic=False
        )
        duration = max(0, current_clock().now_ms() - started)
        results.append((occurrence_ms, now + elapsed, status, error, duration))
        elapsed += duration
    with transaction.atomic(using=db):
        _finish_external(db, name, scheduled_ms, plan, results)
    return {"ran": [r[0] for r in results]}


def _start_external(
    db: str, name: str, scheduled_ms: int, now: int, backlog: dict[str, Any]
) -> dict[str, Any] | None:
    row = store.lock(db, name)
    if row is None:
        return None
    claim_ms = int(get_settings().CLAIM_TIMEOUT_S * 1000)
    if row.running is not None and row.running.get("timer_ms") == scheduled_ms:
        # Our own claim fired again: the worker that ran these occurrences stopped first.
        plan = dict(row.running)
        record_run(row, plan["runs"][-1][0], now, "interrupted", _INTERRUPTED, None)
        event(logging.WARNING, "cron.rerun", schedule=name, occurrences=plan["runs"])
        row.running_until_ms = now + claim_ms
        store.save(db, row, RUN_FIELDS + CHAIN_FIELDS)
        return plan
    if not _live(row, scheduled_ms):
        event(logging.DEBUG, "cron.stale", schedule=name, scheduled_ms=scheduled_ms)
        return None
    _check_mode(row, atomic=False)
    decision = _decide(row, scheduled_ms, now, backlog)
    note_skips(row, decision)
    if not decision.runs:
        _advance(db, row, decision.next_ms, now, _next_backlog(decision))
        store.save(db, row, CHAIN_FIELDS)
        return None
    if not decision.backlog:
        row.busy_since_ms = now
    row.running = {
        "timer_ms": scheduled_ms,
        "runs": [[run.occurrence_ms, run.catch_up, run.missed] for run in decision.runs],
        "next_ms": decision.next_ms,
        "next": _next_backlog(decision),
        "handler": row.handler,
        "kwargs": row.kwargs,
        "tz": row.timezone,
    }
    row.running_until_ms = now + claim_ms
    row.next_ms = decision.next_ms  # its timer is inserted when the runs are over
    store.save(db, row, (*CHAIN_FIELDS, "busy_since_ms"))
    return dict(row.running)


_INTERRUPTED = "the worker running it stopped before it finished; it runs again"


def _finish_external(
    db: str,
    name: str,
    scheduled_ms: int,
    plan: dict[str, Any],
    results: list[tuple[int, int, str, str, int]],
) -> None:
    row = store.lock(db, name)
    if row is None or row.running is None or row.running.get("timer_ms") != scheduled_ms:
        event(logging.WARNING, "cron.orphan_run", schedule=name, occurrences=plan["runs"])
        return
    for occurrence_ms, started_ms, status, error, duration in results:
        record_run(row, occurrence_ms, started_ms, status, error, duration)
    row.running = None
    row.running_until_ms = None
    if row.enabled and row.next_ms is not None:
        # A change made during the runs moved next_ms: the backlog decision is void.
        backlog = plan["next"] if row.next_ms == plan["next_ms"] else {}
        _advance(db, row, row.next_ms, results[-1][1] + results[-1][4], backlog)
    store.save(db, row, RUN_FIELDS + CHAIN_FIELDS)


def _batch_scope(
    db: str, timers: Sequence[Any], batch: FiringBatch
) -> AbstractContextManager[None]:
    """The ``cron`` kind's batch scope: the batch's atomic occurrences fire together."""
    now_ms = batch.now_ms
    names = [t.target for t in timers if _modes.get(t.target) is not False]
    if not names:
        return nullcontext()
    return together.together(
        db,
        names,
        now_ms,
        fields=RUN_FIELDS + CHAIN_FIELDS,
        advance=partial(_advance_past_taken, db, now_ms),
    )


def _advance_past_taken(db: str, now_ms: int, row: CronSchedule, timer: Any) -> None:
    """A held next timer's key was used already: move the row past it, one by one."""
    event(logging.ERROR, "cron.key_taken", schedule=row.name, occurrence=timer.fire_at_ms)
    next_ms = row_spec(row).recurrence().next_after(max(timer.fire_at_ms, now_ms))
    _advance(db, row, next_ms, now_ms, {})


register_batch_scope("cron", _batch_scope)


def _advance(db: str, row: CronSchedule, next_ms: int, now: int, backlog: dict[str, Any]) -> None:
    """Point the row at occurrence ``next_ms`` and insert its timer."""
    for _ in range(3):
        timer = store.insert_occurrence(db, row.name, next_ms, now, **backlog)
        if timer.state == TimerState.PENDING:
            break
        # That occurrence's key was used already (clocks that disagree): move past it.
        event(logging.ERROR, "cron.key_taken", schedule=row.name, occurrence=next_ms)
        next_ms = row_spec(row).recurrence().next_after(max(next_ms, now))
        backlog = {}
    row.next_ms = next_ms
