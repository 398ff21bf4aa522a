"""Operator actions on timers and schedules: fire now, reschedule, retry, run a schedule now.

What the admin's actions call; usable from a shell too. Each function writes in the
caller's transaction on ``DURABLE["DATABASE"]`` and never commits on its own.

**Moving a timer replaces it.** A worker's wheel holds timer ids at the fire time it
loaded, and the fire path trusts the row, not the wheel's time: updating ``fire_at_ms``
in place could fire a postponed timer at its old, earlier time (breaking "never early"),
and a timer moved earlier would still wait for its old slot (the wheel ignores an id it
already holds). So :func:`reschedule`, :func:`fire_now` and :func:`retry` write a new
row with the same handler, arguments, key, parent, children and ``on_complete``, and
cancel the old one (without a follow-up) with ``result = {"replaced_by": <new id>}``.
Code that must find a timer again after an operator moved it should use its key.
A timer of a concurrency key keeps its key (see ``docs/how-to/concurrency.md``).

Only timers of kind ``handler``, ``celery`` and ``signal`` (a scheduled signal) can be
moved: a cron occurrence belongs
to its schedule's chain (use :func:`run_schedule_now`), a workflow wake-up to its run
(use ``durable.workflows.operations.retry``).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

import durable
from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.errors import sanitize_error
from durable.core.sharding import bucket_of
from durable.core.timeutil import ms_to_datetime
from durable.exceptions import ScheduleError, TimerError
from durable.models import CronSchedule, Timer, TimerKind, TimerState
from durable.scheduling import validation
from durable.scheduling.cron import Occurrence, schedule_function
from durable.storage import concurrency
from durable.storage import schedules as schedule_store
from durable.storage import timers as timer_store
from durable.storage.parents import canceled_among

__all__ = ["fire_now", "reschedule", "retry", "run_schedule_now"]

log = logging.getLogger("durable.operations")

#: Kinds whose timers an operator may move; see the module docstring.
MOVABLE_KINDS = frozenset({TimerKind.HANDLER.value, TimerKind.CELERY.value, TimerKind.SIGNAL.value})
#: Fields copied from a timer to its replacement.
_COPIED = (
    "shard",
    "kind",
    "target",
    "args",
    "kwargs",
    "max_attempts",
    "backoff_base_s",
    "backoff_max_s",
    "parent_id",
    "on_complete",
    "context",
)


def reschedule(
    timer_or_id: Timer | int, *, at: datetime | None = None, delay: timedelta | None = None
) -> Timer | None:
    """Move a pending timer to ``at`` (aware) or ``now + delay``; return its replacement.

    None when the timer is no longer pending (it fired, failed, was cancelled, or is
    being fired right now). Attempts already made are kept. See the module docstring
    for why the timer gets a new id.
    """
    if (at is None) == (delay is None):
        raise TypeError("reschedule() takes exactly one of at= or delay=")
    now_ms = current_clock().now_ms()
    # Like schedule(): an aware datetime or a timedelta >= 0, not after MAX_INSTANT, and
    # rounded up to the millisecond (never early).
    fire_at_ms = validation.fire_at_ms(at, delay, now_ms)
    return _replace(timer_or_id, TimerState.PENDING, max(fire_at_ms, now_ms), now_ms, reset=False)


def fire_now(timer_or_id: Timer | int) -> Timer | None:
    """Make a pending timer due now; return its replacement (None if no longer pending)."""
    now_ms = current_clock().now_ms()
    return _replace(timer_or_id, TimerState.PENDING, now_ms, now_ms, reset=False)


def retry(timer_or_id: Timer | int) -> Timer | None:
    """Fire a dead-lettered (failed) timer again now, with a fresh set of attempts.

    Returns the replacement, or None if the timer is not failed. The failed row is
    marked cancelled and keeps its ``last_error``; its ``on_complete`` follow-up (the
    failure) was delivered already, and the replacement gets its own.
    """
    now_ms = current_clock().now_ms()
    return _replace(timer_or_id, TimerState.FAILED, now_ms, now_ms, reset=True)


def _replace(
    timer_or_id: Timer | int, expected: str, fire_at_ms: int, now_ms: int, *, reset: bool
) -> Timer | None:
    timer_id = timer_or_id.pk if isinstance(timer_or_id, Timer) else timer_or_id
    if isinstance(timer_id, bool) or not isinstance(timer_id, int):
        raise TypeError(f"timer_or_id: expected a Timer or its id, got {timer_or_id!r}")
    conf = get_settings()
    db = conf.DATABASE
    with transaction.atomic(using=db, savepoint=False):
        # A worker firing this timer holds its row lock: we wait for its outcome, and
        # PostgreSQL re-checks the state filter on the row as it committed.
        old = (
            Timer.objects.using(db).select_for_update().filter(pk=timer_id, state=expected).first()
        )
        if old is None:
            return None
        # A replacement under a cancelled parent would be a pending child of a cancelled
        # tree (born-cancelled rule, durable.storage.parents): refuse, naming the parent.
        orphaned = old.parent_id is not None and bool(canceled_among(db, [old.parent_id]))
        if old.kind in MOVABLE_KINDS and not orphaned:
            new = _swap(db, conf.BUCKET_SHIFT, old, fire_at_ms, now_ms, reset)
            log.info("timer.replaced old=%s new=%s fire_at_ms=%s", timer_id, new.pk, fire_at_ms)
            return new
    # Raised outside the block: an error inside a savepoint-less atomic block would doom
    # the caller's whole transaction, not just this call.
    if orphaned:
        raise TimerError(
            f"timer {timer_id}: its parent {old.parent_id} is cancelled, so it cannot fire "
            "again (a child of a cancelled parent is cancelled with it)",
            timer=timer_id,
        )
    hint = (
        "run its schedule now instead"
        if old.kind == TimerKind.CRON
        else "cancel or retry its workflow run instead"
    )
    raise TimerError(f"timer {timer_id} is a {old.kind} timer; {hint}", timer=timer_id)


def _swap(db: str, shift: int, old: Timer, fire_at_ms: int, now_ms: int, reset: bool) -> Timer:
    """Cancel ``old`` (locked) and insert its replacement due at ``fire_at_ms``."""
    # The key moves to the replacement: release it first (it is unique).
    Timer.objects.using(db).filter(pk=old.pk).update(
        state=TimerState.CANCELED, key=None, updated_at=ms_to_datetime(now_ms)
    )
    new = timer_store.new_timer(
        **{name: getattr(old, name) for name in _COPIED},
        bucket=bucket_of(fire_at_ms, shift),
        fire_at_ms=fire_at_ms,
        state=TimerState.PENDING,
        key=old.key,
        attempts=0 if reset else old.attempts,
        last_error=old.last_error,
        # Its key's limit still binds it. Made due now (fire now), a pending timer keeps
        # its place in the key's line, so over the limit it waits where it was; moved
        # later, or retried, it is a new arrival then.
        concurrency_key=old.concurrency_key,
        queued_ms=old.queued_ms
        if old.state == TimerState.PENDING and fire_at_ms <= now_ms
        else None,
    )
    timer_store.insert_timer(db, new)
    Timer.objects.using(db).filter(pk=old.pk).update(result={"replaced_by": new.pk})
    # Children follow, so that cancelling the replacement still cascades to them.
    Timer.objects.using(db).filter(parent_id=old.pk).update(parent_id=new.pk)
    timer_store.announce(db, [new], now_ms)
    if old.concurrency_key is not None and old.queued_ms is not None:
        # It was in its key's line: woken, it held a slot, which is free unless it kept it.
        concurrency.release_keys(db, [old.concurrency_key], now_ms, shift)
    return new


# -- schedules ------------------------------------------------------------------------


def run_schedule_now(name: str) -> Timer:
    """Queue one extra run of schedule ``name`` now, outside its calendar; return its timer.

    The run goes through a worker like any timer: it calls the schedule's handler with
    an occurrence whose ``scheduled_at`` is now, and records its outcome in the
    schedule's last-run fields and counters. The calendar is not touched: the next
    occurrence stays as planned. A run of an atomic schedule locks the schedule row, so
    it never overlaps a scheduled run; an ``atomic=False`` one is skipped while a
    scheduled run is in progress.
    """
    validation.check_text(name, "name")  # NUL would fail in the database's query
    row = CronSchedule.objects.using(get_settings().DATABASE).filter(name=name).first()
    if row is None:
        raise ScheduleError(f"no schedule named {name!r}", schedule=name)
    handler = run_schedule_atomic if row.atomic else run_schedule_external
    return durable.schedule(handler, kwargs={"name": name})


@durable.handler(max_attempts=1)
def run_schedule_atomic(name: str) -> dict[str, Any]:
    """Run an atomic schedule's handler once, in the firing transaction (see above)."""
    db = get_settings().DATABASE
    row = schedule_store.lock(db, name)
    if row is None:
        return {"ran": False, "reason": "no such schedule"}
    now_ms = _fire_ms()
    status, error = _call(db, row, now_ms, atomic=True)
    _record(db, row, now_ms, status, error)
    return {"ran": True, "status": status}


@durable.handler(atomic=False, max_attempts=1)
def run_schedule_external(name: str) -> dict[str, Any]:
    """Run an ``atomic=False`` schedule's handler once, outside any transaction."""
    db = get_settings().DATABASE
    row = schedule_store.get(db, name)
    if row is None:
        return {"ran": False, "reason": "no such schedule"}
    if row.running is not None:
        log.info("cron.run_now_skipped schedule=%s reason=running", name)
        return {"ran": False, "reason": "a scheduled run is in progress"}
    now_ms = _fire_ms()
    status, error = _call(db, row, now_ms, atomic=False)
    with transaction.atomic(using=db):
        locked = schedule_store.lock(db, name)
        if locked is not None:
            _record(db, locked, now_ms, status, error)
    return {"ran": True, "status": status}


def _fire_ms() -> int:
    # The worker's database-corrected time of this fire, as scheduled occurrences get.
    ctx = durable.current_fire()
    return ctx.fired_ms if ctx is not None else current_clock().now_ms()


def _call(db: str, row: CronSchedule, now_ms: int, *, atomic: bool) -> tuple[str, str]:
    """Call the schedule's function; return ``(status, sanitized error)``, never raise."""
    occurrence = Occurrence.build(row.name, row.timezone, now_ms, now_ms, catch_up=False, missed=0)
    try:
        fn = schedule_function(row.handler)  # a lookup: row data is never imported
        if atomic:
            with transaction.atomic(using=db):  # a failure undoes only the handler's writes
                fn(occurrence, **row.kwargs)
        else:
            fn(occurrence, **row.kwargs)
    except Exception as exc:
        error = sanitize_error(exc)
        log.warning("cron.run_now_failed schedule=%s error=%s", row.name, error)
        return CronSchedule.Status.FAILED, error
    return CronSchedule.Status.SUCCEEDED, ""


def _record(db: str, row: CronSchedule, now_ms: int, status: str, error: str) -> None:
    # Only the fields people read. The chain's own (last_scheduled_ms, last_started_ms,
    # last_duration_ms, busy_since_ms, next_ms) decide overlaps and catch-up, and a
    # manual run is neither: touching them could make the calendar skip an occurrence.
    row.last_run_at = ms_to_datetime(now_ms)
    row.last_status = status
    row.last_error = error
    fields = ["last_run_at", "last_status", "last_error"]
    if status == CronSchedule.Status.SUCCEEDED:
        row.fired_count += 1
        fields.append("fired_count")
    else:
        row.failed_count += 1
        fields.append("failed_count")
    schedule_store.save(db, row, fields)
