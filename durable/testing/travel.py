"""Time travel in tests: the real engine, in the test's database, on a manual clock.

:func:`time_machine` starts a :class:`~durable.worker.engine.Engine` on a
:class:`~durable.testing.ManualClock` that the scheduling API reads too, and hands back
a :class:`TimeMachine`. ``machine.advance(days=30)`` moves the clock through every
instant at which a timer is due, in order, firing at each what the engine fires there
(handlers, workflow wake-ups, crons, signals), and returns a :class:`Trip` saying what
fired and which workflow runs ended. A timer that a fire schedules inside the window
fires in the same call, at its own instant: the next instant is read from the database
after every one, never planned ahead.

Everything runs on the calling thread, on the test's own database connection: external
handlers and workflow replays (which a worker runs on its handler threads) run at once
in place (:class:`InlinePool`), and new timers reach the engine because the machine
reads what is due from the rows before each turn, not through NOTIFY. So it works
inside pytest-django's ``db`` fixture (a transaction rolled back after the test, where
``on_commit`` hooks and notifications never fire) as well as ``transactional_db``, on
SQLite and PostgreSQL.

Differences from a deployed worker, on purpose: retention pruning is off (a 30-day trip
would delete the finished rows a test wants to look at), leases outlive any trip, and
handlers have no deadline (a step runs on the test's thread).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from durable.conf import get_settings
from durable.core.clock import SystemClock
from durable.core.timeutil import datetime_to_ms, ms_to_datetime
from durable.storage import travel as rows
from durable.testing import ManualClock, override_clock
from durable.worker.engine import Engine
from durable.worker.pool import HandlerPool

log = logging.getLogger("durable.testing")

#: Turns at one instant before the machine gives up on timers that stay due there.
MAX_TURNS_PER_INSTANT = 100
_NEVER = 2**62  # a rescan time no trip reaches
_FINISHED = ("completed", "failed", "canceled")


class InlinePool(HandlerPool):
    """A handler pool that runs each call at once on the calling thread.

    What a worker runs on its handler threads (external handlers, workflow replays)
    runs in the test's thread and transaction instead, in the order it was submitted.
    """

    def __init__(self, size: int = 10_000) -> None:
        super().__init__(0, name="durable-inline")
        # The firer claims at most this many external timers per batch: no parking.
        self.size = size

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` now; an error is logged, as a handler thread would."""
        try:
            fn(*args)
        except Exception:  # the callers contain their own; this is the last net
            log.exception("inline pool: a call raised")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fire:
    """One attempt at a timer during a trip."""

    timer_id: int
    kind: str
    """``handler``, ``workflow`` (a run's wake-up), ``cron``, ``task``, ``signal``..."""
    target: str
    """The handler's dotted name, or the run id of a workflow wake-up."""
    key: str
    due: datetime
    """When the timer was due."""
    at: datetime
    """The manual clock's time when the engine fired it."""
    state: str
    """What the attempt left: ``fired``, ``failed`` (dead letter), ``retrying``..."""
    attempt: int
    error: str = ""

    def __str__(self) -> str:
        error = f" error={self.error!r}" if self.error else ""
        return (
            f"{self.at.isoformat()} {self.kind} {self.target} timer={self.timer_id} "
            f"attempt={self.attempt} -> {self.state}{error}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEnd:
    """A workflow run that ended during a trip."""

    run_id: str
    name: str
    state: str
    """``completed``, ``failed`` or ``canceled``."""
    result: Any = None
    error: str = ""


@dataclass(slots=True, kw_only=True)
class Trip:
    """What happened during one :meth:`TimeMachine.advance`: fires in order, runs ended."""

    start: datetime
    end: datetime
    fires: list[Fire] = field(default_factory=list)
    runs: list[RunEnd] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.fires)

    def __iter__(self) -> Iterator[Fire]:
        return iter(self.fires)

    def targets(self, kind: str | None = None) -> list[str]:
        """The targets fired, in order (only those of ``kind`` if given)."""
        return [fire.target for fire in self.fires if kind is None or fire.kind == kind]

    @property
    def completed(self) -> list[str]:
        """Ids of the workflow runs that completed during the trip, in the order they ended."""
        return [run.run_id for run in self.runs if run.state == "completed"]

    @property
    def failed(self) -> list[str]:
        """Ids of the workflow runs that failed during the trip, in the order they ended."""
        return [run.run_id for run in self.runs if run.state == "failed"]

    def __str__(self) -> str:
        lines = [f"trip {self.start.isoformat()} -> {self.end.isoformat()}: {len(self)} fires"]
        lines += [f"  {fire}" for fire in self.fires]
        lines += [f"  run {run.run_id} ({run.name}) {run.state}" for run in self.runs]
        return "\n".join(lines)


class TimeMachine:
    """The manual clock and the engine of :func:`time_machine`; move time with :meth:`advance`."""

    def __init__(self, engine: Engine, clock: ManualClock) -> None:
        self.engine = engine
        self.clock = clock
        self.db = engine.db
        self.history: list[Fire] = []
        """Every fire of every trip so far, in order."""

    def now(self) -> datetime:
        """The manual clock's time, an aware UTC datetime."""
        return ms_to_datetime(self.clock.now_ms())

    def advance(
        self,
        delta: timedelta | None = None,
        /,
        *,
        days: float = 0,
        hours: float = 0,
        minutes: float = 0,
        seconds: float = 0,
    ) -> Trip:
        """Move the clock forward, firing everything due on the way, in order; return the
        :class:`Trip`. ``advance()`` alone fires what is due now (a run just started)."""
        step = (delta or timedelta()) + timedelta(
            days=days, hours=hours, minutes=minutes, seconds=seconds
        )
        if step < timedelta():
            raise ValueError(f"advance() cannot move backwards, got {step!r}")
        return self._travel(self.clock.now_ms() + int(step.total_seconds() * 1000))

    def advance_to(self, when: datetime) -> Trip:
        """:meth:`advance` up to the aware datetime ``when`` (not before now)."""
        if not isinstance(when, datetime) or when.tzinfo is None:
            raise ValueError(f"advance_to() needs an aware datetime, got {when!r}")
        target = datetime_to_ms(when)
        if target < self.clock.now_ms():
            raise ValueError(f"advance_to() cannot move backwards: {when} is before {self.now()}")
        return self._travel(target)

    def _travel(self, target_ms: int) -> Trip:
        trip = Trip(start=self.now(), end=ms_to_datetime(target_ms))
        watched: set[str] = set()
        while True:
            self._fire_due(trip, watched)
            following = rows.next_due_ms(self.db, self.clock.now_ms(), target_ms)
            if following is None:
                break  # nothing more inside the window
            self.clock.set(following)
        self.clock.set(target_ms)
        self._fire_due(trip, watched)
        self._record_ends(trip, watched)
        self.history.extend(trip.fires)
        return trip

    def _fire_due(self, trip: Trip, watched: set[str]) -> None:
        """Run engine turns at this instant until nothing is due at it any more."""
        now = self.clock.now_ms()
        for _ in range(MAX_TURNS_PER_INSTANT):
            due = rows.due_timers(self.db, now)
            if not due:
                return
            for timer in due:  # as NOTIFY would: the wheel dedupes what it has already
                runner = self.engine.runners.get(timer["shard"])
                if runner is not None:
                    runner.add(timer["id"], timer["fire_at_ms"])
            # Every due row was just fed to its wheel, so the engine's periodic rescans
            # (a query per shard at each instant the clock jumps to) would find nothing.
            for runner in self.engine.runners.values():
                runner.next_rescan_ms = _NEVER
            self.engine.tick()
            self._record_fires(trip, due, watched)
        stuck = ", ".join(f"{t['id']} ({t['kind']} {t['target']})" for t in due[:10])
        raise RuntimeError(
            f"time_machine: timers stay due at {self.now()} after {MAX_TURNS_PER_INSTANT} "
            f"engine turns: {stuck}; is their shard held by another node?"
        )

    def _record_fires(self, trip: Trip, due: list[dict[str, Any]], watched: set[str]) -> None:
        after = rows.timer_outcomes(self.db, [timer["id"] for timer in due])
        at = self.now()
        for timer in due:
            now = after.get(timer["id"])
            if now is None or (now["state"] == "pending" and now["attempts"] == timer["attempts"]):
                continue  # not fired in this turn (pruned rows are not: pruning is off)
            state = now["state"]
            if state == "pending":
                state = "retrying"
            trip.fires.append(
                Fire(
                    timer_id=timer["id"],
                    kind=timer["kind"],
                    target=timer["target"],
                    key=timer["key"] or "",
                    due=ms_to_datetime(timer["fire_at_ms"]),
                    at=at,
                    state=state,
                    attempt=now["attempts"],
                    error=now["last_error"] if state != "fired" else "",
                )
            )
            if timer["kind"] == "workflow":
                watched.add(timer["target"])

    def _record_ends(self, trip: Trip, watched: set[str]) -> None:
        """Add the runs woken during the trip that are now finished, in the order they
        ended (that of their last wake-up)."""
        states = rows.run_states(self.db, watched)
        last = {fire.target: n for n, fire in enumerate(trip.fires) if fire.kind == "workflow"}
        for run_id in sorted(last, key=last.__getitem__):
            row = states.get(run_id)
            if row is None or row["state"] not in _FINISHED:
                continue
            trip.runs.append(
                RunEnd(
                    run_id=run_id,
                    name=row["name"],
                    state=row["state"],
                    result=row["result"],
                    error=row["error"],
                )
            )


@contextmanager
def time_machine(
    start: datetime | None = None, *, node: str = "time-machine"
) -> Iterator[TimeMachine]:
    """Run durable's real engine in this test's database on a manual clock.

    ``start``: the clock's first reading (an aware datetime; default: now, to the
    second). The scheduling API reads the same clock inside the block. Needs database
    access (pytest-django's ``db`` or ``transactional_db``); see the module docstring
    and ``docs/how-to/testing.md``.

    >>> with time_machine() as machine:                       # doctest: +SKIP
    ...     run = onboarding.start(user.pk)
    ...     trip = machine.advance(days=30)
    ...     assert run.pk in trip.completed
    """
    if start is None:
        start_ms = SystemClock().now_ms() // 1000 * 1000
    elif isinstance(start, datetime) and start.tzinfo is not None:
        start_ms = datetime_to_ms(start)
    else:
        raise ValueError(f"time_machine(start=...) needs an aware datetime, got {start!r}")
    clock = ManualClock(start_ms=start_ms)
    conf = dataclasses.replace(
        get_settings(),
        LEASE_TTL_S=1_000_000.0,  # leases outlive any trip (renewed anyway every turn)
        RETENTION_DAYS=36_500.0,  # a century: not a trip (this setting cannot be None)
        FAILED_RETENTION_DAYS=None,
        RUN_RETENTION_DAYS=None,
        DISPATCH="inline",  # run every handler here, never ship it to executor processes
        RAFT=None,  # one engine, alone in the test's database: the leases decide
    )
    with override_clock(clock):
        engine = Engine(node=node, clock=clock, conf=conf, pool=InlinePool())
        # The gauges are Prometheus's (nothing scrapes a test); sampling them, due at each
        # instant the clock jumps to, cost a third of a 30-day trip.
        engine.chores.sample = lambda now: None  # type: ignore[method-assign]
        engine.start()
        engine.tick()  # takes every shard
        try:
            yield TimeMachine(engine, clock)
        finally:
            engine.shutdown(wait_s=0)
