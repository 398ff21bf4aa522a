"""``durable.schedules``: create, change, pause, resume and delete schedules at run time.

Every function writes in the caller's transaction on ``DURABLE["DATABASE"]`` and takes
effect without restarting anything: a change deletes the pending occurrence timer and
inserts the new next one in that same transaction (a worker firing the old one at that
moment finds the schedule moved on and does nothing); pause deletes it; resume inserts
the occurrence that was next when the schedule was paused, so the missed ones since then
follow the schedule's ``catch_up`` policy. A rolled-back change leaves nothing behind.

:func:`sync` is what ``durable.scheduling.cron.sync_declared`` runs at worker start.

>>> durable.schedules.create("digest", "myapp.jobs.digest", cron="0 8 * * *", tz="Europe/Paris")
>>> durable.schedules.update("digest", cron="30 7 * * mon-fri", kwargs={"lang": "fr"})
>>> durable.schedules.pause("digest"); durable.schedules.resume("digest")
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.exceptions import ScheduleError
from durable.models import CronSchedule, TimerState
from durable.scheduling.callables import check_stored_binding, handler_path
from durable.scheduling.occurrences import forget_mode
from durable.scheduling.specs import (
    SPEC_FIELDS,
    ScheduleSpec,
    apply_spec,
    build_spec,
    row_spec,
)
from durable.scheduling.validation import check_text
from durable.storage import schedules as store

__all__ = ["create", "delete", "get", "pause", "resume", "update"]

_UNSET: Any = object()
_CALENDAR = ("kind", "expression", "interval_ms", "anchor_ms", "tz")


def create(
    name: str,
    handler: Any,
    *,
    cron: str | None = None,
    every: timedelta | None = None,
    anchor: datetime | None = None,
    tz: str = "UTC",
    catch_up: str = "fire_once",
    overlap: str = "skip",
    grace: timedelta = timedelta(minutes=1),
    atomic: bool = True,
    enabled: bool = True,
    kwargs: dict[str, Any] | None = None,
) -> CronSchedule:
    """Create schedule ``name`` running ``handler(occurrence, **kwargs)``; return its row.

    ``handler`` is a module-level function or its dotted path; pass ``cron=`` (with
    ``tz=``) or ``every=`` (a ``timedelta`` or seconds, with ``anchor=``); the policies
    and ``kwargs`` are those of ``@durable.cron``. A name that exists raises
    :class:`ScheduleError`. Its first occurrence is the first one after now.
    """
    spec = build_spec(
        name=name,
        handler=handler,
        cron=cron,
        every=every,
        anchor=anchor,
        tz=tz,
        catch_up=catch_up,
        overlap=overlap,
        grace=grace,
        atomic=atomic,
        kwargs=kwargs,
    )
    db, now = _context()
    with transaction.atomic(using=db, savepoint=False):
        row = _insert(db, spec, now, enabled=enabled)
        if row is None:
            raise ScheduleError(
                f"name: schedule {name!r} exists; change it with durable.schedules.update()",
                schedule=name,
            )
    return row


def update(
    name: str,
    *,
    handler: Any = _UNSET,
    cron: str | None = _UNSET,
    every: timedelta | None = _UNSET,
    anchor: datetime | None = _UNSET,
    tz: str = _UNSET,
    catch_up: str = _UNSET,
    overlap: str = _UNSET,
    grace: timedelta = _UNSET,
    atomic: bool = _UNSET,
    kwargs: dict[str, Any] | None = _UNSET,
) -> CronSchedule:
    """Change schedule ``name``: only the arguments given change; return its row.

    Passing ``cron=`` turns an interval schedule into a cron one and ``every=`` the
    reverse. A new calendar takes effect at once: the pending occurrence is replaced by
    the first occurrence of the new calendar after now. ``kwargs=`` replaces the keyword
    arguments of the next runs (checked against the function if this process has it
    registered; ``{}`` or ``None`` removes them).
    """
    db, now = _context()
    with transaction.atomic(using=db, savepoint=False):
        row = _locked(db, name)
        current = row_spec(row)
        options = _options(current)
        given = {
            "handler": handler,
            "cron": cron,
            "every": every,
            "anchor": anchor,
            "tz": tz,
            "catch_up": catch_up,
            "overlap": overlap,
            "grace": grace,
            "atomic": atomic,
            "kwargs": kwargs,
        }
        given = {key: value for key, value in given.items() if value is not _UNSET}
        if "cron" in given and given["cron"] is not None:
            options.update(every=None, anchor=None)
        if "every" in given and given["every"] is not None:
            options.update(cron=None, tz="UTC")
        options.update(given)
        # The stored path is row data: kept as it is, never imported. A new handler is
        # the caller's and is checked like create()'s.
        new_handler = options.pop("handler")
        spec = build_spec(name=name, source=row.source, handler=None, **options)
        path = current.handler
        try:
            if "handler" in given:
                path = handler_path(new_handler, registered=True, kwargs=spec.kwargs)
            elif "kwargs" in given:
                check_stored_binding(path, spec.kwargs)
        except ScheduleError as exc:
            attrs = {**exc.attrs, "schedule": name}
            raise ScheduleError(f"schedule {name!r}: {exc}", **attrs) from None
        spec = dataclasses.replace(spec, handler=path)
        reschedule(db, row, spec, now)
    return row


def pause(name: str) -> CronSchedule:
    """Stop firing schedule ``name`` until :func:`resume`; a run in progress finishes."""
    db, _ = _context()
    with transaction.atomic(using=db, savepoint=False):
        row = _locked(db, name)
        if row.enabled:
            row.enabled = False
            if row.running is None and row.next_ms is not None:
                store.drop_occurrence(db, name, row.next_ms)
            store.save(db, row, ["enabled"])
    return row


def resume(name: str) -> CronSchedule:
    """Fire schedule ``name`` again; occurrences missed while paused follow ``catch_up``."""
    db, now = _context()
    with transaction.atomic(using=db, savepoint=False):
        row = _locked(db, name)
        if not row.enabled:
            row.enabled = True
            if row.next_ms is None:
                row.next_ms = row_spec(row).recurrence().next_after(now)
            if row.running is None:  # else the run in progress inserts it when done
                store.insert_occurrence(db, name, row.next_ms, now)
            store.save(db, row, ["enabled", "next_ms"])
    return row


def delete(name: str) -> bool:
    """Delete schedule ``name`` and its pending occurrence; False if there is none.

    A declared schedule (decorator or ``CRONS``) comes back at the next sync unless its
    declaration is removed too.
    """
    db, _ = _context()
    with transaction.atomic(using=db, savepoint=False):
        row = store.lock(db, _checked(name))
        if row is None:
            return False
        if row.next_ms is not None:
            store.drop_occurrence(db, name, row.next_ms)
        store.delete(db, row)
        forget_mode(name)
    return True


def get(name: str) -> CronSchedule:
    """Return schedule ``name``'s row (``ScheduleError`` if there is none)."""
    db, _ = _context()
    row = store.get(db, _checked(name))
    if row is None:
        raise ScheduleError(f"no schedule named {name!r}", schedule=name)
    return row


# -- shared with the sync --------------------------------------------------------------


def reschedule(
    db: str, row: CronSchedule, spec: ScheduleSpec, now: int, also: tuple[str, ...] = ()
) -> None:
    """Apply ``spec`` to a locked row; a new calendar replaces the pending occurrence.

    ``also`` names other fields the caller changed, saved in the same UPDATE.
    """
    old = row_spec(row)
    apply_spec(row, spec)
    forget_mode(row.name)
    fields = [*SPEC_FIELDS, *also]
    if any(getattr(old, name) != getattr(spec, name) for name in _CALENDAR):
        # Never step back before the last occurrence that ran (clocks disagree a little).
        after = max(now, row.last_scheduled_ms or now)
        new_next = spec.recurrence().next_after(after)
        if row.enabled and row.running is None and new_next != row.next_ms:
            if row.next_ms is not None:
                store.drop_occurrence(db, row.name, row.next_ms)
            store.insert_occurrence(db, row.name, new_next, now)
        row.next_ms = new_next
        fields.append("next_ms")
    store.save(db, row, fields)


def _insert(db: str, spec: ScheduleSpec, now: int, *, enabled: bool) -> CronSchedule | None:
    """Insert a schedule and its first occurrence; None if the name is taken."""
    row = CronSchedule(name=spec.name, source=spec.source, enabled=enabled)
    apply_spec(row, spec)
    if spec.source != "api":
        row.declaration = spec.declaration()
    row.next_ms = spec.recurrence().next_after(now)
    try:
        with transaction.atomic(using=db):  # a concurrent creator wins; we report it
            store.insert(db, row)
    except IntegrityError:
        return None
    if enabled:
        store.insert_occurrence(db, spec.name, row.next_ms, now)
    return row


def _checked(name: Any) -> str:
    """``name`` if it can be looked up: a str without NUL or a lone surrogate."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a schedule name (str), got {type(name).__name__}")
    return check_text(name, "name")


def _locked(db: str, name: str) -> CronSchedule:
    row = store.lock(db, _checked(name))
    if row is None:
        raise ScheduleError(f"no schedule named {name!r}", schedule=name)
    return row


def _context() -> tuple[str, int]:
    return get_settings().DATABASE, current_clock().now_ms()


def _options(spec: ScheduleSpec) -> dict[str, Any]:
    """``build_spec`` arguments that reproduce ``spec``."""
    from durable.core.timeutil import ms_to_datetime

    interval = spec.kind == "interval"
    return {
        "handler": spec.handler,
        "cron": None if interval else spec.expression,
        "every": timedelta(milliseconds=spec.interval_ms or 0) if interval else None,
        "anchor": ms_to_datetime(spec.anchor_ms) if interval and spec.anchor_ms else None,
        "tz": spec.tz,
        "catch_up": spec.catch_up,
        "overlap": spec.overlap,
        "grace": timedelta(milliseconds=spec.grace_ms),
        "atomic": spec.atomic,
        "kwargs": spec.kwargs,
    }


# -- declared schedules ----------------------------------------------------------------


@dataclass(slots=True)
class SyncReport:
    """What :func:`sync` did, by schedule name."""

    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    undeclared: list[str] = field(default_factory=list)
    unchanged: int = 0

    def __str__(self) -> str:
        parts = [
            f"{label} {len(names)} ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
            for label, names in (
                ("created", self.created),
                ("updated", self.updated),
                ("repaired", self.repaired),
                ("paused as undeclared", self.undeclared),
            )
            if names
        ]
        return "; ".join([*parts, f"unchanged {self.unchanged}"])


def sync(db: str | None, now_ms: int | None, specs: list[ScheduleSpec]) -> SyncReport:
    """Make the declared schedules' rows match ``specs`` (see ``sync_declared``)."""
    db = db or get_settings().DATABASE
    now = current_clock().now_ms() if now_ms is None else now_ms
    report = SyncReport()
    for spec in specs:
        # One short transaction per schedule: a starting worker never holds many locks.
        with transaction.atomic(using=db):
            _sync_one(db, spec, now, report)
    names = {spec.name for spec in specs}
    for name in store.declared_names(db):
        if name in names:
            continue
        # One row per transaction, like the rest: locking them all at once could deadlock
        # with a firing batch that locks two of them in the other order.
        with transaction.atomic(using=db):
            row = store.lock(db, name)
            if row is None or row.declaration is None or row.source == "api":
                continue
            row.declaration = None
            if row.enabled and row.running is None and row.next_ms is not None:
                store.drop_occurrence(db, row.name, row.next_ms)
            row.enabled = False
            store.save(db, row, ["declaration", "enabled"])
            report.undeclared.append(row.name)
    return report


def _sync_one(db: str, spec: ScheduleSpec, now: int, report: SyncReport) -> None:
    row = store.lock(db, spec.name)
    if row is None:
        if _insert(db, spec, now, enabled=True) is not None:
            report.created.append(spec.name)
            return
        row = store.lock(db, spec.name)  # another worker created it meanwhile
        assert row is not None
    declaration = spec.declaration()
    if row.declaration != declaration or row.source != spec.source:
        # Declared again after it was dropped from the code: it comes back on.
        revive = row.declaration is None and row.source != "api" and not row.enabled
        row.declaration = declaration
        row.source = spec.source
        reschedule(db, row, spec, now, also=("declaration", "source"))
        if revive:
            row.enabled = True
            store.save(db, row, ["enabled"])
            _repair(db, row, now)
        report.updated.append(spec.name)
    elif _repair(db, row, now):
        report.repaired.append(spec.name)
    else:
        report.unchanged += 1


def _repair(db: str, row: CronSchedule, now: int) -> bool:
    """Put back the occurrence timer of an enabled schedule that has none; True if it did."""
    if not row.enabled:
        return False
    if row.running is not None:
        claim_ms = int(get_settings().CLAIM_TIMEOUT_S * 1000)
        state = store.occurrence_state(db, row.name, row.running.get("timer_ms", -1))
        expired = (row.running_until_ms or 0) + claim_ms < now
        if not expired or state in (TimerState.PENDING, TimerState.FIRING):
            return False  # the claimed timer re-runs it when its claim expires
        row.running = None
        row.running_until_ms = None
    if row.next_ms is None:
        row.next_ms = row_spec(row).recurrence().next_after(now)
    state = store.occurrence_state(db, row.name, row.next_ms)
    if state in (TimerState.PENDING, TimerState.FIRING):
        return False
    if state is not None:  # its timer finished without moving the chain on (dead letter)
        row.next_ms = row_spec(row).recurrence().next_after(max(now, row.next_ms))
    store.insert_occurrence(db, row.name, row.next_ms, now)
    store.save(db, row, ["next_ms", "running", "running_until_ms"])
    return True


#: ``durable.schedules`` is this module; the lazy export needs an attribute to name.
schedules = sys.modules[__name__]
