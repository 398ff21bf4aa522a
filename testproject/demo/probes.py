"""Handlers the worker tests fire. Each writes ``FireRecord`` rows, so tests count effects.

They live in an importable module (not in a test file) because acceptance tests run real
worker processes that resolve handlers by dotted name.
"""

from __future__ import annotations

import time
from datetime import timedelta

import durable
from durable.dispatch.context import current_fire
from testproject.demo.models import FireRecord

#: Calls per key and the (shard, token) a handler saw, for in-process tests only.
CALLS: dict[str, int] = {}
LAST_CONTEXT: dict[str, tuple[int | None, int | None]] = {}


def _now_ms() -> int:
    ctx = current_fire()
    return ctx.fired_ms if ctx else time.time_ns() // 1_000_000


@durable.handler
def record(key: str) -> str:
    """Write one row for ``key`` (atomic: exactly once)."""
    ctx = current_fire()
    if ctx is not None:
        LAST_CONTEXT[key] = (ctx.shard, ctx.token)
    FireRecord.objects.create(key=key, fired_at_ms=_now_ms(), due_at_ms=ctx and ctx.scheduled_ms)
    return key


@durable.handler(max_attempts=3)
def fail_until(key: str, succeed_on_attempt: int) -> int:
    """Raise until attempt ``succeed_on_attempt``; the failed attempts' rows roll back."""
    ctx = current_fire()
    assert ctx is not None
    CALLS[key] = CALLS.get(key, 0) + 1
    FireRecord.objects.create(key=f"{key}:attempt", fired_at_ms=_now_ms())
    if ctx.attempt < succeed_on_attempt:
        raise RuntimeError(f"planned failure in /srv/app/secret/path.py attempt {ctx.attempt}")
    FireRecord.objects.create(key=key, fired_at_ms=_now_ms())
    return ctx.attempt


@durable.handler(atomic=False, max_attempts=2)
def record_external(key: str) -> str:
    """Outside-effect handler (at least once): writes a row in its own transaction."""
    ctx = current_fire()
    assert ctx is not None
    FireRecord.objects.create(key=key, fired_at_ms=_now_ms(), due_at_ms=ctx.scheduled_ms)
    return ctx.idempotency_key


@durable.handler
def outcome(timer_id: int, context: object, result: dict) -> None:
    """An ``on_complete`` target: records the follow-up it received."""
    FireRecord.objects.create(key=f"outcome:{context}:{result['status']}", fired_at_ms=_now_ms())


@durable.handler
def record_then_schedule(key: str, delay_ms: int) -> int:
    """Write a row for ``key``, then schedule ``record(key + ":next")`` ``delay_ms`` later."""
    record(key)
    child = durable.schedule(
        record, args=[f"{key}:next"], key=f"{key}:next", delay=timedelta(milliseconds=delay_ms)
    )
    return child.pk
