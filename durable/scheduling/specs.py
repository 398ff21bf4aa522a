"""A schedule's declaration as a value (:class:`ScheduleSpec`), and its validation.

One validator serves the decorators, ``DURABLE["CRONS"]``, the run-time API and
``manage.py check``: every error is a :class:`~durable.exceptions.ScheduleError` that
names the offending argument and carries the system-check id it maps to (``check_id``,
``durable.E010`` to ``durable.E019``, listed in ``docs/reference/settings.md``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from durable.core import cron as calendar
from durable.core.catchup import CATCH_UP_POLICIES, OVERLAP_POLICIES, Policy
from durable.core.timeutil import ceil_ms, datetime_to_ms
from durable.exceptions import ScheduleError
from durable.scheduling.callables import check_kwargs, handler_path
from durable.scheduling.validation import MAX_INSTANT, MAX_INSTANT_MS

MAX_NAME_LENGTH = 200
SETTINGS_KEYS = frozenset(
    {"task", "cron", "every", "tz", "catch_up", "overlap", "grace", "atomic", "anchor", "kwargs"}
)
MAX_INTERVAL = timedelta(days=366)
"""The longest ``every`` (one year, leap day included); longer belongs to a cron calendar."""
_ONE_SECOND = timedelta(seconds=1)


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
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the function receives at each occurrence (a JSON object)."""
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
        if not data["kwargs"]:  # rows synced before kwargs existed compare equal
            del data["kwargs"]
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


class Problems:
    """Every problem found in one declaration, raised together as one ``ScheduleError``.

    ``where`` names the declaration in each message: the decorated function
    (``@durable.cron on myapp.crons.digest``), the ``CRONS`` entry
    (``DURABLE['CRONS']['nightly']``) or the schedule (``schedule 'digest'``).
    """

    def __init__(self, where: str, name: str) -> None:
        self.where = where
        self.name = name
        self.found: list[ScheduleError] = []

    def add(self, message: str, check_id: str, field: str) -> None:
        """Note one problem: ``message`` starts with the argument it is about."""
        self.found.append(
            ScheduleError(
                f"{self.where}: {message}", schedule=self.name, field=field, check_id=check_id
            )
        )

    def raise_if_any(self) -> None:
        """Raise one ``ScheduleError`` listing every problem (``.problems``: each alone)."""
        if not self.found:
            return
        first = self.found[0]
        text = "; ".join(str(p).removeprefix(f"{self.where}: ") for p in self.found)
        raise ScheduleError(
            f"{self.where}: {text}",
            schedule=self.name,
            field=first.field,
            check_id=first.check_id,
            problems=list(self.found),
        )


def build_spec(
    *,
    name: str,
    handler: Any,
    source: str = "api",
    cron: str | None = None,
    every: timedelta | float | None = None,
    anchor: datetime | None = None,
    tz: str = "UTC",
    catch_up: str = "fire_once",
    overlap: str = "skip",
    grace: timedelta | float = timedelta(minutes=1),
    atomic: bool = True,
    kwargs: dict[str, Any] | None = None,
    where: str = "",
    problems: Problems | None = None,
) -> ScheduleSpec:
    """Validate one schedule's arguments and return its :class:`ScheduleSpec`.

    ``handler`` is a module-level function or its dotted path (``None`` checks the other
    arguments only). A run-time schedule (``source="api"``) must name a function the
    worker has registered (see :func:`handler_path`). ``every`` and ``grace`` take a
    ``timedelta`` or a number of seconds. ``kwargs`` (a JSON object within
    ``DURABLE["MAX_PAYLOAD_BYTES"]``) are passed to the function at each occurrence and
    must bind to its signature. Every problem is reported, in one ``ScheduleError``
    whose message starts with ``where`` (default: ``schedule '<name>'``).
    """
    found = problems or Problems(where or f"schedule {name!r}", str(name))
    _check_name(name, found)
    kind, expression, interval_ms, anchor_ms = _calendar(cron, every, anchor, found)
    grace_ms = _check_options(tz, catch_up, overlap, grace, atomic, found)
    kw: dict[str, Any] | None = None  # None: refused, so not bound to the function either
    try:
        kw = check_kwargs(kwargs)
    except ScheduleError as exc:
        found.add(str(exc), exc.check_id, "kwargs")
    path = ""
    if handler is not None:
        try:
            path = handler_path(handler, registered=source == "api", kwargs=kw)
        except ScheduleError as exc:
            found.add(str(exc), exc.check_id, exc.field)
    found.raise_if_any()
    return ScheduleSpec(
        name=name,
        handler=path,
        kind=kind,
        expression=expression,
        interval_ms=interval_ms,
        anchor_ms=anchor_ms,
        tz=tz if kind == "cron" else "UTC",
        catch_up=catch_up,
        overlap=overlap,
        grace_ms=grace_ms,
        atomic=atomic,
        kwargs=kw or {},
        source=source,
    )


def _check_options(
    tz: Any, catch_up: Any, overlap: Any, grace: Any, atomic: Any, found: Problems
) -> int:
    try:
        calendar.zone(tz)
    except ValueError as exc:
        found.add(f"tz: {exc}", "durable.E011", "tz")
    if not isinstance(catch_up, str) or catch_up not in CATCH_UP_POLICIES:
        found.add(
            f"catch_up: expected one of {', '.join(CATCH_UP_POLICIES)}; got {catch_up!r}",
            "durable.E012",
            "catch_up",
        )
    if not isinstance(overlap, str) or overlap not in OVERLAP_POLICIES:
        found.add(
            f"overlap: expected one of {', '.join(OVERLAP_POLICIES)}; got {overlap!r}",
            "durable.E013",
            "overlap",
        )
    period = _duration(grace)
    if period is None or period < timedelta(0):
        found.add(
            f"grace: expected a non-negative timedelta or number of seconds, got {grace!r}",
            "durable.E018",
            "grace",
        )
    if not isinstance(atomic, bool):
        found.add(f"atomic: expected True or False, got {atomic!r}", "durable.E018", "atomic")
    return ceil_ms(period) if period is not None and period >= timedelta(0) else 0


def _duration(value: Any) -> timedelta | None:
    """``value`` as a timedelta (numbers are seconds); None if it is not a finite one."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value):
        return None
    try:
        return timedelta(seconds=value)
    except OverflowError:  # beyond timedelta's 999,999,999 days
        return None


def _check_name(name: Any, found: Problems) -> None:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LENGTH:
        found.add(
            f"name: expected 1 to {MAX_NAME_LENGTH} characters, got {name!r}",
            "durable.E019",
            "name",
        )
    elif not name.isprintable() or name != name.strip():
        found.add(
            f"name: {name!r} has control characters or surrounding spaces",
            "durable.E019",
            "name",
        )


def _calendar(
    cron: Any, every: Any, anchor: Any, found: Problems
) -> tuple[str, str, int | None, int]:
    if (cron is None) == (every is None):
        found.add("cron/every: pass exactly one of cron= and every=", "durable.E015", "cron")
        return "cron", "", None, 0
    if cron is not None:
        if anchor is not None:
            found.add("anchor: only for every= schedules", "durable.E017", "anchor")
        try:
            return "cron", calendar.check_expression(cron), None, 0
        except ValueError as exc:
            found.add(f"cron: {exc}", "durable.E010", "cron")
            return "cron", "", None, 0
    anchor_ms = 0
    if anchor is not None:
        if not isinstance(anchor, datetime) or anchor.utcoffset() is None:
            found.add(
                f"anchor: expected an aware datetime, got {anchor!r}", "durable.E017", "anchor"
            )
        elif datetime_to_ms(anchor) > MAX_INSTANT_MS:
            found.add(
                f"anchor: {anchor!r} is after {MAX_INSTANT.isoformat()}, the latest instant "
                "durable accepts",
                "durable.E017",
                "anchor",
            )
        else:
            anchor_ms = datetime_to_ms(anchor)
    period = _duration(every)
    if period is None or not _ONE_SECOND <= period <= MAX_INTERVAL:
        found.add(
            f"every: expected a timedelta or a number of seconds from 1 s to "
            f"{MAX_INTERVAL.days} days, got {every!r}",
            "durable.E017",
            "every",
        )
        return "interval", "", None, anchor_ms
    if period % timedelta(milliseconds=1):
        found.add(f"every: {every!r} is not whole milliseconds", "durable.E017", "every")
    return "interval", "", period // timedelta(milliseconds=1), anchor_ms


def settings_spec(name: str, entry: Any) -> ScheduleSpec:
    """Validate one ``DURABLE["CRONS"]`` entry: ``{"task": path, "cron"|"every": ...}``.

    Every problem of the entry is reported at once, each naming the entry.
    """
    found = Problems(f"DURABLE['CRONS'][{name!r}]", str(name))
    if not isinstance(entry, dict):
        found.add(f"expected a dict, got {type(entry).__name__}", "durable.E015", "")
        found.raise_if_any()
    unknown = sorted(set(entry) - SETTINGS_KEYS)
    if unknown:
        found.add(
            f"unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(SETTINGS_KEYS))}",
            "durable.E015",
            unknown[0],
        )
    if "task" not in entry:
        found.add("task: missing (the function's dotted path)", "durable.E015", "task")
    options = {key: value for key, value in entry.items() if key in SETTINGS_KEYS - {"task"}}
    return build_spec(
        name=name, handler=entry.get("task"), source="settings", problems=found, **options
    )


def settings_specs(crons: Any) -> list[ScheduleSpec]:
    """Validate all of ``DURABLE["CRONS"]``; the first bad entry raises ``ScheduleError``."""
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
        kwargs=dict(row.kwargs or {}),
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
    row.kwargs = dict(spec.kwargs)


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
    "kwargs",
)
