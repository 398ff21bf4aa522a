"""Fixtures of the workflow integration tests: an in-process worker driven by a manual clock.

Workflow replays run on the worker's executor threads (``atomic=False`` handlers), so
:meth:`Driver.turn` advances the clock, runs one engine turn and then waits until no
replay is in flight: each turn is a deterministic step of the whole system. New wake-up
timers reach the wheel through the rescan (every ``RESCAN_INTERVAL_S`` = 1 s of manual
time), which is why a turn advances the clock by a second by default.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest

from durable.models import Timer, WorkflowRun
from durable.testing import ManualClock
from durable.worker.engine import Engine
from testproject.demo.models import FireRecord

START_MS = 1_900_000_000_000


class Driver:
    """Moves the manual clock and the engine together, one turn at a time."""

    def __init__(self, engine: Engine, clock: ManualClock) -> None:
        self.engine = engine
        self.clock = clock

    def turn(self, advance: timedelta | int = 1_000) -> None:
        """Advance the clock, run one engine turn, wait for the replays it started."""
        self.clock.advance(advance)
        self.engine.tick()
        self.idle()

    def idle(self, timeout_s: float = 20.0) -> None:
        """Wait until no external handler (replay) is running on the executor."""
        deadline = time.monotonic() + timeout_s
        while self.engine.firer.in_flight:
            if time.monotonic() > deadline:
                raise AssertionError("replays still in flight after 20 s")
            time.sleep(0.005)

    def until(self, predicate: Callable[[], object], turns: int = 30) -> None:
        """Run turns until ``predicate()`` holds; fail after ``turns`` turns."""
        for _ in range(turns):
            if predicate():
                return
            self.turn()
        raise AssertionError(f"not reached after {turns} turns: {predicate}")

    def state(self, run: WorkflowRun | str) -> str:
        """The run's state, read now."""
        pk = run.pk if isinstance(run, WorkflowRun) else run
        return str(WorkflowRun.objects.values_list("state", flat=True).get(pk=pk))

    def settle(self, run: WorkflowRun | str, *states: str, turns: int = 30) -> WorkflowRun:
        """Run turns until the run is in one of ``states``; return it."""
        self.until(lambda: self.state(run) in states, turns)
        pk = run.pk if isinstance(run, WorkflowRun) else run
        return WorkflowRun.objects.get(pk=pk)


@pytest.fixture
def driver(clock: ManualClock, start_engine) -> Driver:
    """A started engine owning all 4 shards, and its driver."""
    settings = {
        "SHARDS": 4,
        "LEASE_TTL_S": 3600.0,
        "RESCAN_INTERVAL_S": 1.0,
        "BACKOFF_BASE_S": 1.0,
        "BACKOFF_MAX_S": 60.0,
    }
    engine = start_engine(settings, node="wf-test", threads=4)
    assert sorted(engine.runners) == [0, 1, 2, 3]
    return Driver(engine, clock)


def records(prefix: str = "") -> list[str]:
    """Keys of the FireRecord rows (effects) starting with ``prefix``, sorted."""
    rows = FireRecord.objects.filter(key__startswith=prefix).values_list("key", flat=True)
    return sorted(rows)


def wake_timers(run: WorkflowRun, state: str = "pending") -> list[Timer]:
    """The run's wake-up timers in ``state``."""
    return list(Timer.objects.filter(kind="workflow", target=run.pk, state=state))
