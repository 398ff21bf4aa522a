"""Fixtures shared by the integration tests: a manual clock and started engines.

Tests drive the worker a turn at a time (``Engine.tick()``) with a
:class:`durable.testing.ManualClock` that both the scheduling API and the engine read,
so nothing sleeps. A module that needs another start time defines its own ``clock``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from durable.testing import ManualClock, override_clock
from durable.worker.engine import Engine

START_MS = 1_900_000_000_000


@pytest.fixture
def clock() -> Iterator[ManualClock]:
    """The manual clock the scheduling API and the engine both read."""
    manual = ManualClock(start_ms=START_MS)
    with override_clock(manual):
        yield manual


@pytest.fixture
def start_engine(clock: ManualClock, settings: Any) -> Iterator[Callable[..., Engine]]:
    """A factory: ``start_engine(DURABLE settings or None, node=..., threads=...)``.

    Sets ``settings.DURABLE`` (unless None), starts an engine on the test's clock and
    runs one turn, so it holds every shard it can; the executors of every engine it
    started are shut down after the test.
    """
    started: list[Engine] = []

    def start(
        durable: dict[str, Any] | None, *, node: str = "test-node", threads: int = 2
    ) -> Engine:
        if durable is not None:
            settings.DURABLE = durable
        engine = Engine(node=node, clock=clock, threads=threads)
        engine.start()
        engine.tick()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.executor.shutdown(wait=True)
        engine.firer.ahead.close()  # its thread's connection too
