"""A schedule's declaration as a value (:class:`ScheduleSpec`), and its validation.

One validator serves the decorators, ``DURABLE["CRONS"]``, the run-time API and
``manage.py check``: every error is a :class:`~durable.exceptions.ScheduleError` that
names the offending argument and carries the system-check id it maps to (``check_id``,
``durable.E010`` to ``durable.E019``, listed in ``docs/reference/settings.md``).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from durable.core import cron as calendar
from durable.core.catchup import CATCH_UP_POLICIES, OVERLAP_POLICIES, Policy
from durable.core.timeutil import ceil_ms, datetime_to_ms
from durable.exceptions import ScheduleError, UnknownHandler

MAX_NAME_LENGTH = 200
SETTINGS_KEYS = frozenset(
    {"task", "cron", "every", "tz", "catch_up", "overlap", "grace", "atomic", "anchor"}
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    """A validated schedule: calendar, policies and the function it runs."""

    name: str
    handler: str
    """Dotted path of the function called with the :class:`Occurrence`."""
    kind: str
    """``"cron"`` or ``"interval"``."""
    expression: str = ""
    interval_ms: int | None = None
    anchor_ms: int = 0
    tz: str = "UTC"
    catch_up: str = "fire_once"
    overlap: str = "skip"
    grace_ms: int = 60_000
    atomic: bool = True
    source: str = "api"
    """``"code"`` (decorators), ``"settings"`` (``CRONS``) or ``"api"`` (run time)."""

    def recurrence(self) -> calendar.Recurrence:
        """The calendar of occurrences."""
        if self.kind == "interval":
            assert self.interval_ms is not None
            return calendar.IntervalRecurrence(self.interval_ms, self.anchor_ms)
        return _cron(self.expression, self.tz)

    def policy(self) -> Policy:
        """The catch-up and overlap policies."""
        return Policy(catch_up=self.catch_up, overlap=self.overlap, grace_ms=self.grace_ms)

    def declaration(self) -> dict[str, Any]:
        """The fields a declaration sets, as JSON (what the sync compares)."""
        data = asdict(self)
        del data["name"], data["source"]
        return data


_CRON_CACHE: dict[tuple[str, str], calendar.CronRecurrence] = {}


def _cron(expression: str, tz: str) -> calendar.CronRecurrence:
    # Parsing is ~100 us; a 1-second cron would pay it at every fire. Bounded by the
    # number of distinct (expression, zone) pairs a process ever sees.
    key = (expression, tz)
    found = _CRON_CACHE.get(key)
    if found is None:
        if len(_CRON_CACHE) > 10_000:
            _CRON_CACHE.clear()
        found = _CRON_CACHE[key] = calendar.CronRecurrence(expression, tz)
    return found


def _fail(message: str, check_id: str, name: str, field: str) -> ScheduleError:
    return ScheduleError(message, schedule=name, field=field, check_id=check_id)


def build_spec(
    *,
    name: str,
    handler: Any,
    source: str = "api",
    cron: str | None = None,
    every: timedelta | None = None,
    anchor: datetime | None = None,
    tz: str = "UTC",
    catch_up: str = "fire_once",
    overlap: str = "skip",
    grace: timedelta = timedelta(minutes=1),
    atomic: bool = True,
) -> ScheduleSpec:
    """Validate one schedule's arguments and return its :class:`ScheduleSpec`.

    ``handler`` is a module-level function or its dotted path (``None`` checks the other
    arguments only, as the decorators do before they see the function). A run-time
    schedule (``source="api"``) must name a function the worker has registered
    (see :func:`handler_path`).
    """
    _check_name(name)
    api = source == "api"
    kind, expression, interval_ms, anchor_ms = _calendar(name, cron, every, anchor)
    _check_options(name, tz, catch_up, overlap, grace, atomic)
    return ScheduleSpec(
        name=name,
        handler="" if handler is None else handler_path(handler, name, registered=api),
        kind=kind,
        expression=expression,
        interval_ms=interval_ms,
        anchor_ms=anchor_ms,
        tz=tz if kind == "cron" else "UTC",
        catch_up=catch_up,
        overlap=overlap,
        grace_ms=ceil_ms(grace),
        atomic=atomic,
        source=source,
    )


def _check_options(
    name: str, tz: Any, catch_up: Any, overlap: Any, grace: Any, atomic: Any
) -> None:
    try:
        calendar.zone(tz)
    except ValueError as exc:
        raise _fail(f"tz: {exc}", "durable.E011", name, "tz") from None
    if catch_up not in CATCH_UP_POLICIES:
        raise _fail(
            f"catch_up: expected one of {', '.join(CATCH_UP_POLICIES)}; got {catch_up!r}",
            "durable.E012",
            name,
            "catch_up",
        )
    if overlap not in OVERLAP_POLICIES:
        raise _fail(
            f"overlap: expected one of {', '.join(OVERLAP_POLICIES)}; got {overlap!r}",
            "durable.E013",
            name,
            "overlap",
        )
    if not isinstance(grace, timedelta) or grace < timedelta(0):
        raise _fail(
            f"grace: expected a non-negative timedelta, got {grace!r}",
            "durable.E018",
            name,
            "grace",
        )
    if not isinstance(atomic, bool):
        raise _fail(
            f"atomic: expected True or False, got {atomic!r}", "durable.E018", name, "atomic"
        )


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
        raise _fail(
            f"name: expected 1 to {MAX_NAME_LENGTH} characters, got {name!r}",
            "durable.E019",
            str(name),
            "name",
        )
    if not name.isprintable() or name != name.strip():
        raise _fail(
            f"name: {name!r} has control characters or surrounding spaces",
            "durable.E019",
            name,
            "name",
        )


def _calendar(name: str, cron: Any, every: Any, anchor: Any) -> tuple[str, str, int | None, int]:
    if (cron is None) == (every is None):
        raise _fail("pass exactly one of cron= and every=", "durable.E015", name, "cron")
    if cron is not None:
        if anchor is not None:
            raise _fail("anchor: only for every= schedules", "durable.E017", name, "anchor")
        try:
            return "cron", calendar.check_expression(cron), None, 0
        except ValueError as exc:
            raise _fail(f"cron: {exc}", "durable.E010", name, "cron") from None
    if not isinstance(every, timedelta) or every < timedelta(seconds=1):
        raise _fail(
            f"every: expected a timedelta of at least 1 second, got {every!r}",
            "durable.E017",
            name,
            "every",
        )
    if every % timedelta(milliseconds=1):
        raise _fail(f"every: {every!r} is not whole milliseconds", "durable.E017", name, "every")
    anchor_ms = 0
    if anchor is not None:
        if not isinstance(anchor, datetime) or anchor.utcoffset() is None:
            raise _fail(
                f"anchor: expected an aware datetime, got {anchor!r}",
                "durable.E017",
                name,
                "anchor",
            )
        anchor_ms = datetime_to_ms(anchor)
    return "interval", "", every // timedelta(milliseconds=1), anchor_ms


def handler_path(handler: Any, name: str = "", *, registered: bool = False) -> str:
    """Return the dotted path of a schedule's function, checking it can be called by it.

    The function must be a module-level, synchronous function that accepts one positional
    argument (the :class:`Occurrence`); a dotted path must import to such a function.
    The path comes from code (a decorator, ``CRONS``, a caller of ``durable.schedules``),
    never from a row, so importing it is fine. With ``registered``, the function must
    also be one the worker can find by name: declared with ``@durable.cron`` or
    ``@durable.every``, named in ``CRONS``, or decorated with ``@durable.handler``.
    """
    where = f"schedule {name!r}: " if name else ""
    fn = _import(handler, where) if isinstance(handler, str) else handler
    if not inspect.isfunction(fn):
        raise _fail(
            f"{where}handler: expected a module-level function, got {type(fn).__name__}",
            "durable.E016",
            name,
            "handler",
        )
    path = f"{fn.__module__}.{fn.__qualname__}"
    if "<locals>" in path or "<lambda>" in path:
        raise _fail(
            f"{where}handler: {path} is not importable by name; define it at module level",
            "durable.E016",
            name,
            "handler",
        )
    if inspect.iscoroutinefunction(fn):
        raise _fail(f"{where}handler: {path} is async", "durable.E016", name, "handler")
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise _fail(
            f"{where}handler: {path} must accept one positional argument (the occurrence)",
            "durable.E016",
            name,
            "handler",
        ) from None
    if registered:
        _check_registered(handler if isinstance(handler, str) else path, where, name)
    return handler if isinstance(handler, str) else path


def _check_registered(path: str, where: str, name: str) -> None:
    from durable.scheduling.cron import schedule_function

    try:
        schedule_function(path)
    except UnknownHandler as exc:
        raise _fail(f"{where}handler: {exc}", "durable.E016", name, "handler") from None


def _import(path: str, where: str) -> Any:
    from django.utils.module_loading import import_string

    try:
        return import_string(path)
    except ImportError as exc:
        raise ScheduleError(
            f"{where}handler: cannot import {path!r} ({exc})",
            field="handler",
            check_id="durable.E016",
        ) from None


def settings_spec(name: str, entry: Any) -> ScheduleSpec:
    """Validate one ``DURABLE["CRONS"]`` entry: ``{"task": path, "cron"|"every": ...}``."""
    where = f"DURABLE['CRONS'][{name!r}]"
    if not isinstance(entry, dict):
        raise _fail(
            f"{where}: expected a dict, got {type(entry).__name__}", "durable.E015", str(name), ""
        )
    unknown = sorted(set(entry) - SETTINGS_KEYS)
    if unknown:
        raise _fail(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(SETTINGS_KEYS))}",
            "durable.E015",
            str(name),
            unknown[0],
        )
    if "task" not in entry:
        raise _fail(
            f"{where}: missing 'task' (the function's dotted path)",
            "durable.E015",
            str(name),
            "task",
        )
    options = {key: value for key, value in entry.items() if key != "task"}
    for key in ("every", "grace"):  # numbers are seconds in settings
        if isinstance(options.get(key), int | float) and not isinstance(options[key], bool):
            options[key] = timedelta(seconds=options[key])
    try:
        return build_spec(name=name, handler=entry["task"], source="settings", **options)
    except ScheduleError as exc:
        raise ScheduleError(f"{where}: {exc}", **exc.attrs) from None


def settings_specs(crons: Any) -> list[ScheduleSpec]:
    """Validate all of ``DURABLE["CRONS"]``; the first problem raises ``ScheduleError``."""
    if not isinstance(crons, dict):
        raise ScheduleError(
            f"DURABLE['CRONS']: expected a dict of name -> entry, got {type(crons).__name__}",
            check_id="durable.E015",
        )
    return [settings_spec(name, entry) for name, entry in crons.items()]


def row_spec(row: Any) -> ScheduleSpec:
    """The :class:`ScheduleSpec` a ``CronSchedule`` row holds (no validation: it was)."""
    return ScheduleSpec(
        name=row.name,
        handler=row.handler,
        kind=row.kind,
        expression=row.expression,
        interval_ms=row.interval_ms,
        anchor_ms=row.anchor_ms,
        tz=row.timezone,
        catch_up=row.catch_up,
        overlap=row.overlap,
        grace_ms=row.grace_ms,
        atomic=row.atomic,
        source=row.source,
    )


def apply_spec(row: Any, spec: ScheduleSpec) -> None:
    """Copy ``spec``'s calendar, policies and handler onto a ``CronSchedule`` row."""
    row.kind = spec.kind
    row.expression = spec.expression
    row.interval_ms = spec.interval_ms
    row.anchor_ms = spec.anchor_ms
    row.timezone = spec.tz
    row.catch_up = spec.catch_up
    row.overlap = spec.overlap
    row.grace_ms = spec.grace_ms
    row.handler = spec.handler
    row.atomic = spec.atomic


SPEC_FIELDS = (
    "kind",
    "expression",
    "interval_ms",
    "anchor_ms",
    "timezone",
    "catch_up",
    "overlap",
    "grace_ms",
    "handler",
    "atomic",
)
