"""Django tasks the Tasks-backend tests enqueue; module level, so the worker imports them.

Decorated with whichever Tasks API is installed: ``django.tasks`` (Django 6) or the
``django-tasks`` backport (Django 5.2). Each writes a ``FireRecord`` row per run.
"""

from __future__ import annotations

import threading
from typing import Any

from durable.dispatch.context import current_fire
from testproject.demo.models import FireRecord

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task  # type: ignore[no-redef]


def _record(key: str) -> None:
    fire = current_fire()
    assert fire is not None, "tasks run only inside the durable worker here"
    FireRecord.objects.create(key=key, fired_at_ms=fire.fired_ms, due_at_ms=fire.scheduled_ms)


@task
def add(a: int, b: int, *, key: str = "add") -> int:
    """Record a run and return the sum."""
    _record(key)
    return a + b


@task(queue_name="emails")
def send_email(to: str) -> dict[str, Any]:
    """A task on its own queue."""
    _record(f"email:{to}")
    return {"sent": to}


@task
def explode(message: str) -> None:
    """Always fails."""
    _record(f"explode:{message}")
    raise ValueError(message)


@task
def deep(levels: int) -> None:
    """Raises from ``levels`` calls down: a traceback longer than durable keeps."""
    _record(f"deep:{levels}")
    _down(levels)


def _down(levels: int) -> None:
    if levels <= 0:
        raise ValueError("at the bottom")
    _down_again(levels - 1)  # alternating frames: Python folds only identical ones


def _down_again(levels: int) -> None:
    _down(levels - 1)


@task
def flaky(key: str) -> str:
    """Fails on its first attempt, succeeds on the next."""
    fire = current_fire()
    assert fire is not None
    _record(f"{key}:{fire.attempt}")
    if fire.attempt == 1:
        raise RuntimeError("first attempt fails")
    return key


@task(takes_context=True)
def with_context(context: Any, key: str) -> dict[str, Any]:
    """Return what the task context says about this run."""
    _record(key)
    return {"id": context.task_result.id, "attempt": context.attempt}


@task
async def asynchronous(key: str) -> str:
    """A coroutine task: run through ``async_to_sync`` on the worker's thread."""
    from asgiref.sync import sync_to_async

    await sync_to_async(_record)(key)
    return key.upper()


@task
def not_json(key: str) -> object:
    """Returns something that is not JSON: the run is recorded as a failure."""
    _record(key)
    return object()


class Halt(BaseException):
    """A BaseException of the application's own, like ``SystemExit`` not an ``Exception``."""


_BASE_EXCEPTIONS = {"exit": SystemExit(3), "interrupt": KeyboardInterrupt(), "halt": Halt()}


@task
def halts(kind: str) -> None:
    """Raises a BaseException that is not an Exception: ``exit``, ``interrupt`` or ``halt``."""
    _record(f"halt:{kind}")
    raise _BASE_EXCEPTIONS[kind]


#: Set by ``watch_itself`` once it has read its own result; the test then reads it too.
STARTED = threading.Event()
#: Set by the test to let ``watch_itself`` return.
RELEASE = threading.Event()


@task(takes_context=True)
def watch_itself(context: Any, key: str) -> dict[str, Any]:
    """Read its own result through the backend while running, wait for the test, return it."""
    _record(key)
    seen = watch_itself.get_result(context.task_result.id)
    STARTED.set()
    assert RELEASE.wait(10), "the test never released the task"
    return {
        "status": str(seen.status),
        "started_at": seen.started_at and seen.started_at.isoformat(),
        "last_attempted_at": seen.last_attempted_at and seen.last_attempted_at.isoformat(),
        "attempts": seen.attempts,
        "worker_ids": seen.worker_ids,
    }


@task
def repeat(n: int) -> str:
    """Return ``n`` x's: a return value as large as asked."""
    _record(f"repeat:{n}")
    return "x" * n
