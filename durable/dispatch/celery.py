"""The ``celery`` timer kind: when the timer fires, publish a Celery task message.

``durable.schedule_celery`` stores a timer of kind ``celery`` whose ``target`` is the
Celery task name and whose ``args``/``kwargs`` are the task's. The wait happens in the
database, not in a Celery worker's memory; when the timer is due, the worker publishes
one message in Celery's task protocol version 2, JSON-serialized, through kombu to
``DURABLE["BROKER_URL"]``, and a stock Celery worker runs it.

The publish runs inside the worker's batch transaction, just before the batch commits
the timers as fired, so 500 publishes share one fenced commit instead of paying a claim
and a completion transaction each (the external ``atomic=False`` path managed about a
hundred a second; see docs/benchmarks.md). The firer runs a batch's handlers inside
:meth:`~durable.dispatch.broker.PublisherPool.deferred`, so on Redis the batch's
messages go out in one pipelined flush before the commit. It is at least once, never exactly
once: a crash or a failed commit after the broker took the message fires the timer
again. The task id is derived from the timer id (``durable-<timer id>``), so such a
second message carries the same id and can be recognised (and deduplicated by a task
that cares). When a batch is rolled back and re-run in the same process (another
handler of the batch raised), :data:`sent` remembers what already went out, so the re-run
does not publish it twice. A publish that fails (broker down, confirm timed out) raises,
and the timer is retried with its backoff: nothing is lost.

Durable cannot see the Celery worker's task registry: a name no worker knows is
published like any other, and the Celery worker logs ``Received unregistered task of
type '<name>'`` and discards it. Durable's log line ``celery.published`` carries the
name and id to correlate with.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from functools import partial
from typing import Any

from durable.conf import get_settings
from durable.dispatch.broker import Outgoing, direct_queue, publishers
from durable.dispatch.context import current_fire
from durable.dispatch.kinds import register_kind
from durable.dispatch.registry import HandlerSpec

log = logging.getLogger("durable.dispatch")

#: Key of ``Timer.kwargs`` holding durable's own publish options (``{"queue": name}``);
#: it is removed before the message is built, so the task never sees it.
OPTIONS_KEY = "__celery__"
#: Celery's default exchange, routing key and queue.
DEFAULT_QUEUE = "celery"
#: Longest ``argsrepr``/``kwargsrepr``, as Celery's own ``argsrepr_maxsize``.
REPR_MAX_CHARS = 1024


class SentLog:
    """The (timer id, attempt) pairs this process published recently, bounded in size.

    A batch the firer rolls back and runs again calls every handler of it twice, and an
    attempt number only changes when a fire commits; so a pair seen here was taken by
    the broker and must not be sent again, whether or not the first batch committed.
    """

    def __init__(self, size: int = 100_000, ttl_s: float = 3600.0) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._seen: OrderedDict[tuple[int, int], float] = OrderedDict()
        self._lock = threading.Lock()

    def seen(self, timer_id: int, attempt: int) -> bool:
        """True if that attempt of that timer was published by this process lately."""
        with self._lock:
            when = self._seen.get((timer_id, attempt))
            return when is not None and time.monotonic() - when < self.ttl_s

    def add(self, timer_id: int, attempt: int) -> None:
        """Remember a publish the broker took."""
        with self._lock:
            self._seen[(timer_id, attempt)] = time.monotonic()
            while len(self._seen) > self.size:
                self._seen.popitem(last=False)


#: This process's log of publishes (see :class:`SentLog`).
sent = SentLog()


def task_id_for(timer_id: int) -> str:
    """The Celery task id of the message a timer publishes: ``durable-<timer id>``."""
    return f"durable-{timer_id}"


def task_message(
    task_name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    *,
    task_id: str,
    origin: str | None = None,
) -> Outgoing:
    """Build a Celery protocol v2 message for ``task_name(*args, **kwargs)``.

    The headers are those Celery's ``app.amqp.as_task_v2`` sets; ``eta`` is None because
    the timer already waited, and ``root_id`` is the task itself (a root task). The body
    is ``[args, kwargs, embed]``, JSON only.
    """
    headers = {
        "lang": "py",
        "task": task_name,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": _short_repr(args),
        "kwargsrepr": _short_repr(kwargs),
        "origin": origin or _origin(),
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    return Outgoing(
        body=[list(args), dict(kwargs), embed],
        headers=headers,
        # content_type/encoding come from the JSON serializer the pool publishes with.
        properties={"correlation_id": task_id, "reply_to": ""},
    )


def publish_task(task_name: str, *args: Any, **kwargs: Any) -> dict[str, str]:
    """Publish the Celery task of the timer being fired; return its task id and queue.

    Called by the worker's firer (through :func:`resolve`) with the timer's args and
    kwargs; the reserved :data:`OPTIONS_KEY` entry is taken out of the kwargs first.
    """
    fire = current_fire()
    if fire is None:
        raise RuntimeError("publish_task() runs only when the worker fires a celery timer")
    options = kwargs.pop(OPTIONS_KEY, None) or {}
    queue = options.get("queue") or DEFAULT_QUEUE
    task_id = task_id_for(fire.timer_id)
    if sent.seen(fire.timer_id, fire.attempt):
        return {"task_id": task_id, "queue": queue}  # a re-run batch: it went out already
    message = task_message(task_name, list(args), kwargs, task_id=task_id)
    publishers.publish(
        get_settings().BROKER_URL,
        message,
        direct_queue(queue),
        on_sent=partial(_published, fire.timer_id, fire.attempt, task_name, queue),
    )
    return {"task_id": task_id, "queue": queue}


def _published(timer_id: int, attempt: int, task_name: str, queue: str) -> None:
    """The broker took the message: remember it (see :class:`SentLog`) and log it."""
    sent.add(timer_id, attempt)
    _event(
        "celery.published",
        timer=timer_id,
        task=task_name,
        id=task_id_for(timer_id),
        queue=queue,
        attempt=attempt,
    )


def resolve(task_name: str) -> HandlerSpec:
    """The ``celery`` kind's resolver: a timer's target is the Celery task name.

    ``atomic=True`` means "run in the batch transaction" (see the module docstring): the
    publish itself is at least once.
    """
    return HandlerSpec(name=f"celery:{task_name}", fn=partial(publish_task, task_name), atomic=True)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= REPR_MAX_CHARS else text[: REPR_MAX_CHARS - 3] + "..."


def _origin() -> str:
    # Celery's format for the sending node ("gen<pid>@<host>"), named after us.
    return f"durable{os.getpid()}@{socket.gethostname()}"


def _event(name: str, **fields: Any) -> None:
    # The worker's structured-event format (durable.worker.logs), without importing
    # upwards from dispatch into the worker.
    if log.isEnabledFor(logging.INFO):
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        log.info("%s %s", name, text, extra={"durable": {"event": name, **fields}})


register_kind("celery", resolve)
