"""Declaring schedules: ``@durable.cron``, ``@durable.every`` and ``DURABLE["CRONS"]``.

Declarations are validated when they are made (a bad expression, time zone or policy
raises :class:`~durable.exceptions.ScheduleError` naming the argument, at import) and
collected in :data:`declared`. They reach the database, as ``CronSchedule`` rows with
their first occurrence timer, through :func:`sync_declared`, which the worker runs at
start and ``manage.py durable_sync_schedules`` runs on demand.

This module imports no models: like ``@durable.handler``, the decorators run while
Django loads apps. Functions receive one :class:`Occurrence`, and the schedule's
``kwargs`` as keyword arguments.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, time, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from durable.core import cron as calendar
from durable.core.timeutil import ms_to_datetime
from durable.dispatch.registry import WHERE_TO_REGISTER, HandlerRegistry, HandlerSpec, handlers
from durable.exceptions import ScheduleError, UnknownHandler
from durable.scheduling.callables import check_unlimited
from durable.scheduling.specs import Problems, ScheduleSpec, build_spec, settings_specs

if TYPE_CHECKING:
    from durable.scheduling.schedules import SyncReport

F = TypeVar("F", bound=Callable[..., Any])
_ONE_MINUTE = timedelta(minutes=1)

__all__ = [
    "Occurrence",
    "ScheduleSpec",
    "cron",
    "declared",
    "every",
    "functions",
    "register_configured",
    "schedule_function",
    "sync_declared",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Occurrence:
    """One occurrence of a schedule, as handed to its function: ``fn(occurrence, **kwargs)``."""

    schedule: str
    """The schedule's name."""
    scheduled_at: datetime
    """When it was due, aware, in the schedule's time zone (UTC for intervals)."""
    scheduled_ms: int
    """The same instant in UTC epoch milliseconds."""
    catch_up: bool
    """True when this run stands in for missed occurrences (worker down, paused)."""
    missed: int
    """How many missed occurrences this run deals with (0 for an on-time run)."""
    fired_at: datetime
    """When this run started (aware UTC)."""

    @property
    def idempotency_key(self) -> str:
        """``"cron:<name>:<scheduled_ms>"``: stable across re-runs of this occurrence."""
        return f"cron:{self.schedule}:{self.scheduled_ms}"

    @classmethod
    def build(
        cls, name: str, tz: str, scheduled_ms: int, fired_ms: int, *, catch_up: bool, missed: int
    ) -> Occurrence:
        """Occurrence ``scheduled_ms`` of schedule ``name`` (zone ``tz``), run at ``fired_ms``."""
        return cls(
            schedule=name,
            scheduled_at=ms_to_datetime(scheduled_ms).astimezone(calendar.zone(tz)),
            scheduled_ms=scheduled_ms,
            catch_up=catch_up,
            missed=missed,
            fired_at=ms_to_datetime(fired_ms),
        )


class DeclaredSchedules:
    """Schedules declared with the decorators, by name. Thread-safe."""

    def __init__(self) -> None:
        self._specs: dict[str, ScheduleSpec] = {}
        self._lock = threading.Lock()

    def register(self, spec: ScheduleSpec) -> ScheduleSpec:
        """Add ``spec``; the same name for another function is a ``ScheduleError``."""
        with self._lock:
            old = self._specs.get(spec.name)
            if old is not None and old.handler != spec.handler:
                raise ScheduleError(
                    f"{spec.handler}: name: schedule {spec.name!r} is already declared for "
                    f"{old.handler}; pass a distinct name=",
                    schedule=spec.name,
                    check_id="durable.E014",
                )
            self._specs[spec.name] = spec  # re-importing a module re-declares it
        return spec

    def unregister(self, name: str) -> None:
        """Forget the declaration ``name`` (tests)."""
        with self._lock:
            self._specs.pop(name, None)

    def specs(self) -> list[ScheduleSpec]:
        """Every declared spec, by name."""
        with self._lock:
            return [self._specs[name] for name in sorted(self._specs)]


#: Filled by the decorators at import time, like ``admin.site``; read by the sync.
declared = DeclaredSchedules()

#: The functions schedules run, by dotted path: registered by ``@durable.cron`` and
#: ``@durable.every`` when their module is imported, and for ``DURABLE["CRONS"]`` by
#: :func:`register_configured` at the worker's start-up.
functions = HandlerRegistry()


def schedule_function(path: str) -> Callable[[Occurrence], Any]:
    """The function a schedule row names, looked up, never imported (the path is row data).

    A schedule runs a function registered by ``@durable.cron``/``@durable.every``, by
    ``DURABLE["CRONS"]``, or by ``@durable.handler`` (what schedules created at run time
    with :mod:`durable.schedules` name). Anything else raises :class:`UnknownHandler`;
    a handler declared with a ``concurrency_key`` raises ``ScheduleError`` (see
    :func:`~durable.scheduling.callables.check_unlimited`): its limits would not hold.
    """
    spec = functions.get(path) or handlers.get(path)
    if spec is None:
        raise UnknownHandler(
            f"unknown schedule function {path!r}: it is not registered (declare it with "
            "@durable.cron or @durable.every, name it in DURABLE['CRONS'], or decorate it "
            f"with @durable.handler); {WHERE_TO_REGISTER}",
            handler=path,
        )
    check_unlimited(path)  # a handler given a limit after the schedule was made
    return spec.fn  # type: ignore[no-any-return]


def register_configured(crons: dict[str, Any] | None = None) -> list[ScheduleSpec]:
    """Validate ``DURABLE["CRONS"]`` and register each entry's function; return the specs.

    The paths come from settings, which are code: importing them here, at start-up, is
    what lets the worker run them later by lookup alone.
    """
    from django.utils.module_loading import import_string

    from durable.conf import get_settings

    specs = settings_specs(get_settings().CRONS if crons is None else crons)
    for spec in specs:
        functions.register(HandlerSpec(name=spec.handler, fn=import_string(spec.handler)))
    return specs


def all_declarations(crons: dict[str, Any] | None = None) -> list[ScheduleSpec]:
    """Decorated schedules (after importing every app's ``crons`` module) and ``CRONS``.

    A name declared both ways is a ``ScheduleError`` (``durable.E014``).
    """
    from django.utils.module_loading import autodiscover_modules

    from durable.conf import get_settings
    from durable.exceptions import ScheduleError

    autodiscover_modules("crons")
    code = declared.specs()
    configured = register_configured(get_settings().CRONS if crons is None else crons)
    names = {spec.name for spec in code}
    for spec in configured:
        if spec.name in names:
            raise ScheduleError(
                f"DURABLE['CRONS'][{spec.name!r}]: a schedule of that name is also declared "
                "with a decorator",
                schedule=spec.name,
                check_id="durable.E014",
            )
    return code + configured


def sync_declared(
    db: str | None = None, now_ms: int | None = None, specs: Iterable[ScheduleSpec] | None = None
) -> SyncReport:
    """Make ``CronSchedule`` rows match the declarations; idempotent.

    The worker calls this at start. It creates missing schedules with their first
    occurrence, applies declarations that changed since the last sync, pauses declared
    schedules that are no longer declared, and puts back a missing occurrence timer.
    Run-time changes (``durable.schedules.pause``...) to a declaration that did not
    change are kept.
    """
    from durable.scheduling.schedules import sync

    return sync(db, now_ms, all_declarations() if specs is None else list(specs))


def _declaration(
    decorator: str, options: dict[str, Any], early: tuple[ScheduleError, ...] = ()
) -> Callable[[F], F]:
    """The decorator ``@durable.cron(...)``/``@durable.every(...)`` returns.

    Validation waits for the function, a line later at import, so that every message
    names it (``@durable.cron on myapp.crons.digest: tz: ...``) and lists every problem
    of the declaration at once; ``early`` holds those found in a helper's arguments.
    """

    def declare(fn: F) -> F:
        name = options.get("name")
        name = name if name is not None else _default_name(fn)
        found = Problems(f"{decorator} on {_default_name(fn)}", str(name))
        for problem in early:
            found.add(str(problem), problem.check_id, problem.field)
        spec = build_spec(
            name=name, handler=fn, source="code", problems=found, **_without(options, "name")
        )
        declared.register(spec)
        functions.register(HandlerSpec(name=spec.handler, fn=fn))
        return fn

    return declare


def _default_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{qualname}"


def _helper_expression(make: Callable[[], str]) -> tuple[str, tuple[ScheduleError, ...]]:
    # A helper's own arguments (at=, on=, day=, minute=) are checked with the rest.
    try:
        return make(), ()
    except ValueError as exc:
        field = str(exc).split(":", 1)[0]
        field = field if field.isidentifier() else "cron"
        return "* * * * *", (ScheduleError(str(exc), field=field, check_id="durable.E010"),)


class CronDecorator:
    """``@durable.cron(expression, ...)`` and its helpers ``hourly``, ``daily``, ``weekly``,
    ``monthly``: declare a module-level function ``fn(occurrence, **kwargs)`` as a schedule.
    """

    def __call__(
        self,
        expression: str,
        *,
        tz: str = "UTC",
        catch_up: str = "fire_once",
        overlap: str = "skip",
        name: str | None = None,
        grace: timedelta | float = _ONE_MINUTE,
        atomic: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> Callable[[F], F]:
        """Run the decorated function at each time ``expression`` matches in zone ``tz``.

        ``catch_up`` (``skip``, ``fire_once``, ``fire_all``) says what happens to
        occurrences missed while no worker ran them; ``overlap`` (``skip``, ``queue``)
        to occurrences due while the previous run is still running; ``grace`` is how
        late an occurrence may fire before it counts as missed. ``name`` defaults to the
        function's dotted name. ``atomic=False`` runs it outside the firing transaction
        (at least once). ``kwargs`` (a JSON object) are passed to the function at each
        occurrence: ``fn(occurrence, **kwargs)``. Bad arguments raise one
        ``ScheduleError`` naming the function and every problem, at import.
        """
        options = {
            "cron": expression,
            "tz": tz,
            "catch_up": catch_up,
            "overlap": overlap,
            "name": name,
            "grace": grace,
            "atomic": atomic,
            "kwargs": kwargs,
        }
        return _declaration("@durable.cron", options)

    def hourly(self, *, minute: int = 0, **options: Any) -> Callable[[F], F]:
        """Every hour at ``minute`` (UTC unless ``tz=``); other options as :meth:`__call__`."""
        return self._helper(lambda: calendar.hourly_expression(minute), options)

    def daily(self, at: str | time = "00:00", **options: Any) -> Callable[[F], F]:
        """Every day at ``at`` (``"HH:MM"`` or a ``time``), on the wall clock of ``tz``."""
        return self._helper(lambda: calendar.daily_expression(at), options)

    def weekly(self, on: str = "mon", at: str | time = "00:00", **options: Any) -> Callable[[F], F]:
        """Every ``on`` (``"mon"``, ``"mon-fri"``, ``"sat,sun"``) at ``at`` in ``tz``."""
        return self._helper(lambda: calendar.weekly_expression(on, at), options)

    def monthly(
        self, day: int | str = 1, at: str | time = "00:00", **options: Any
    ) -> Callable[[F], F]:
        """Day ``day`` (1-31 or ``"last"``) of every month at ``at``; short months skip it."""
        return self._helper(lambda: calendar.monthly_expression(day, at), options)

    def _helper(self, make: Callable[[], str], options: dict[str, Any]) -> Callable[[F], F]:
        expression, early = _helper_expression(make)
        return _declaration("@durable.cron", {"cron": expression, **options}, early)


#: ``@durable.cron(...)``; see :class:`CronDecorator`.
cron = CronDecorator()


def every(
    period: timedelta | float,
    *,
    anchor: datetime | None = None,
    catch_up: str = "fire_once",
    overlap: str = "skip",
    name: str | None = None,
    grace: timedelta | float = _ONE_MINUTE,
    atomic: bool = True,
    kwargs: dict[str, Any] | None = None,
) -> Callable[[F], F]:
    """Run the decorated function every ``period``, in UTC.

    ``period`` is a ``timedelta`` or a number of seconds (``every(90)``), from one
    second to :data:`~durable.scheduling.specs.MAX_INTERVAL` (366 days), in whole
    milliseconds. A fixed duration: the cadence does not move at daylight-saving
    changes. Occurrences are ``anchor + k * period`` (``anchor`` defaults to the Unix
    epoch, so ``every(timedelta(hours=1))`` fires on the hour, the same on every
    worker). Other options, ``kwargs`` included, as :func:`durable.cron`.
    """
    options = {
        "every": period,
        "anchor": anchor,
        "catch_up": catch_up,
        "overlap": overlap,
        "name": name,
        "grace": grace,
        "atomic": atomic,
        "kwargs": kwargs,
    }
    return _declaration("@durable.every", options)


def _without(options: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != key}
