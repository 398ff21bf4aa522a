"""Handlers for the demo and the tests, importable by dotted name from a worker process.

Each writes a :class:`~testproject.demo.models.FireRecord`, so a test counts rows to see
how often a handler really ran, and what it was given.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import durable
from durable.dispatch.context import current_fire
from testproject.demo.models import FireRecord


def _record(key: str, due_at_ms: int | None = None) -> None:
    fire = current_fire()
    FireRecord.objects.create(
        key=key,
        fired_at_ms=fire.fired_ms if fire else 0,
        due_at_ms=due_at_ms if due_at_ms is not None else (fire.scheduled_ms if fire else None),
    )


@durable.handler
def record(key: str, due_at_ms: int | None = None) -> None:
    """Write one ``FireRecord(key=key)``; atomic, so exactly once per timer."""
    _record(key, due_at_ms)


@durable.handler(atomic=False)
def record_external(key: str) -> None:
    """The non-atomic twin of :func:`record`: at-least-once, outside the fire transaction."""
    _record(key)


@durable.handler(max_attempts=3, backoff=timedelta(seconds=10))
def flaky(key: str, fail_times: int = 1) -> str:
    """Raise until it has been called ``fail_times`` times for ``key``, then record and return."""
    calls = FireRecord.objects.filter(key=f"{key}:attempt").count()
    FireRecord.objects.create(key=f"{key}:attempt", fired_at_ms=0)
    if calls < fail_times:
        raise RuntimeError(f"flaky {key}: failing attempt {calls + 1} of {fail_times}")
    _record(key)
    return key


@durable.handler(max_attempts=7, backoff=durable.Backoff(base_s=2.0, max_s=60.0))
def always_fails(key: str) -> None:
    """Always raise: ends in the dead letter (state failed) after its attempts."""
    raise RuntimeError(f"always_fails {key}")


@durable.handler
def on_done(timer_id: int, context: Any, result: dict[str, Any]) -> None:
    """An ``on_complete`` follow-up: records ``done:<timer_id>`` with its inputs as JSON."""
    payload = json.dumps({"context": context, "result": result}, sort_keys=True)
    FireRecord.objects.create(key=f"done:{timer_id}:{payload}"[:200], fired_at_ms=0)


@durable.handler
def noop(*args: Any, **kwargs: Any) -> None:
    """Do nothing; for tests that only look at the timer rows."""


def not_a_handler(key: str) -> None:
    """A plain function, deliberately not decorated: scheduling it must fail."""
