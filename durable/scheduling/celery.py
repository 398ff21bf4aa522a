"""``schedule_celery``: a Celery task sent at a time, waiting in the database meanwhile.

Celery's own ``countdown``/``eta`` publishes at once and the worker holds the message in
memory until it is due: on Redis it is redelivered (and run twice) once the visibility
timeout passes, on RabbitMQ the consumer is killed when ``consumer_timeout`` passes, and
a worker restart puts it back at the end of the queue. ``schedule_celery`` writes a
timer instead (kind ``celery``, in the caller's transaction, like ``schedule()``); the
worker publishes the task when it is due (:mod:`durable.dispatch.celery`).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction

from durable.conf import DurableSettings, get_settings
from durable.core.backoff import Backoff
from durable.core.clock import current_clock
from durable.dispatch.celery import OPTIONS_KEY
from durable.models import Timer, TimerKind
from durable.scheduling import validation as v
from durable.storage import timers as store

#: Longest task or queue name (the ``Timer.target`` column holds 255 characters).
MAX_NAME_CHARS = 255


def schedule_celery(
    task_name: str,
    *,
    args: list[Any] | tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    at: datetime | None = None,
    delay: timedelta | None = None,
    key: str | None = None,
    queue: str | None = None,
    max_attempts: int | None = None,
    backoff: Backoff | timedelta | None = None,
) -> Timer:
    """Send Celery task ``task_name`` with ``args``/``kwargs`` at ``at``, after ``delay``, or now.

    The timer is written in the caller's transaction on ``DURABLE["DATABASE"]``; when it
    fires, the worker publishes a Celery protocol v2 JSON message to
    ``DURABLE["BROKER_URL"]`` on queue ``queue`` (Celery's default ``"celery"`` if None),
    with task id ``durable-<timer id>``. Cancel it with ``durable.cancel(timer)``. With
    ``key``, an existing timer with that key is returned and nothing is written (while
    its row is kept: see ``RETENTION_DAYS``). A publish
    that fails is retried with ``backoff`` up to ``max_attempts`` (defaults: the
    ``DURABLE`` settings). Arguments must be JSON: bad input raises before any write.
    """
    conf = get_settings()
    now_ms = current_clock().now_ms()
    options = {"at": at, "delay": delay, "key": key, "queue": queue}
    options |= {"max_attempts": max_attempts, "backoff": backoff}
    timer = _plan(conf, now_ms, task_name, args, kwargs, options)
    db = conf.DATABASE
    with transaction.atomic(using=db, savepoint=False):
        timer, created = store.insert_timer(db, timer)
        if created:
            store.announce(db, [timer], now_ms)
    return timer


def _plan(
    conf: DurableSettings,
    now_ms: int,
    task_name: Any,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> Timer:
    """Validate ``schedule_celery``'s arguments and return the unsaved timer."""
    # Validate everything first (each error names its argument), then write.
    name = _check_name(task_name, "task_name")
    fire_at_ms = v.fire_at_ms(options["at"], options["delay"], now_ms)
    key = v.check_key(options["key"])
    args, kwargs = v.check_payload(args, kwargs, None, conf.MAX_PAYLOAD_BYTES)
    if OPTIONS_KEY in kwargs:
        raise ValueError(f"kwargs: {OPTIONS_KEY!r} is reserved for durable's publish options")
    if options["queue"] is not None:
        kwargs[OPTIONS_KEY] = {"queue": _check_name(options["queue"], "queue")}
    attempts = v.check_max_attempts(options["max_attempts"]) or conf.MAX_ATTEMPTS
    policy = v.to_backoff(options["backoff"], conf.BACKOFF_MAX_S) or Backoff(
        base_s=conf.BACKOFF_BASE_S, max_s=conf.BACKOFF_MAX_S
    )
    return store.new_pending(
        conf,
        fire_at_ms=fire_at_ms,
        kind=TimerKind.CELERY,
        target=name,
        args=args,
        kwargs=kwargs,
        key=key,
        max_attempts=attempts,
        backoff_base_s=policy.base_s,
        backoff_max_s=policy.max_s,
    )


def _check_name(value: Any, name: str) -> str:
    """Return a task or queue name: a non-empty str without whitespace, at most 255 chars."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if not value or len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{name}: must be 1 to {MAX_NAME_CHARS} characters, got {len(value)}")
    if value != value.strip() or any(c.isspace() for c in value):
        raise ValueError(f"{name}: {value!r} contains whitespace")
    return str(v.check_text(value, name))
