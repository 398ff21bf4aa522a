"""The worker side of ``durable.tasks.DurableBackend``: running one attempt of a task.

The ``task`` timer kind's resolver (:func:`resolve`) looks the timer's module path up in
:data:`durable.tasks.registry`; :func:`run_task` runs the task and records each attempt
(start, errors, return value, worker ids) on the timer row, where
``DurableBackend.get_result`` reads it from any process. Importing this module
registers the kind; ``durable.tasks`` imports it.
"""

from __future__ import annotations

import os
import socket
import traceback
from functools import partial
from typing import TYPE_CHECKING, Any

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.errors import sanitize_error
from durable.dispatch.context import current_fire
from durable.dispatch.kinds import register_kind
from durable.dispatch.registry import HandlerSpec
from durable.exceptions import GiveUp, PayloadError
from durable.scheduling import validation as v
from durable.tasks import (
    _FAILED,
    _FIRED,
    _FIRING,
    _PENDING,
    MAX_TRACEBACK_CHARS,
    TASK_KIND,
    Task,
    TaskAborted,
    TaskContext,
    TaskPayloadError,
    _path,
    _signals,
    _task_of,
    _to_result,
    registry,
)

if TYPE_CHECKING:
    from durable.models import Timer


def resolve(module_path: str) -> HandlerSpec:
    """The ``task`` kind's resolver: run the Django task at ``module_path``, at least once.

    An unregistered path raises :class:`UnknownHandler`: the timer fails, nothing is
    imported.
    """
    task = registry.resolve(module_path)
    backend = task.get_backend()
    timeout = getattr(backend, "timeout_s", None)
    return HandlerSpec(
        name=module_path, fn=partial(run_task, module_path), atomic=False, timeout=timeout
    )


def run_task(module_path: str, *args: Any, **kwargs: Any) -> Any:
    """Run one attempt of the task being fired and record its outcome on its timer.

    The result is written before the task is called (``RUNNING``, with its start, attempt
    time and worker ids) and again when it returns or raises. Sends ``task_started`` and
    ``task_finished``. An ``Exception`` is recorded (class path and traceback) and
    re-raised, so the worker retries or fails the timer (at once for
    :class:`durable.GiveUp`: ``FAILED`` whatever attempts are left); any other
    ``BaseException`` is recorded the same way and re-raised as :class:`TaskAborted`.
    """
    from durable.storage import timers as store

    fire = current_fire()
    if fire is None:
        raise RuntimeError("run_task() runs only when the worker fires a task timer")
    db = get_settings().DATABASE
    timer = store.get_timer(db, fire.timer_id)
    if timer is None:
        raise RuntimeError(f"task timer {fire.timer_id} vanished while firing")
    task = _task_of(timer)
    record = dict(timer.result) if isinstance(timer.result, dict) else {}
    record.setdefault("started_ms", fire.fired_ms)
    record["attempted_ms"] = fire.fired_ms
    record["worker_ids"] = [*record.get("worker_ids", []), _worker_id()]
    # Stored before the call, so get_result() shows the start and attempts while it runs.
    store.store_result(db, timer.pk, record)
    timer.state, timer.result = _FIRING, record
    try:
        _signals.task_started.send(type(task.get_backend()), task_result=_to_result(timer, task))
        value = _call(task, timer, args, kwargs)
    # BaseException too: a task's SystemExit or KeyboardInterrupt is its failure (as in
    # Django's own backends), not the worker's; signals reach only the main thread.
    except BaseException as exc:
        record["errors"] = [*record.get("errors", []), _error(exc)]
        final = fire.attempt >= timer.max_attempts or isinstance(exc, GiveUp)
        _finish(db, timer, task, record, _FAILED if final else _PENDING)
        if isinstance(exc, Exception):
            raise
        raise TaskAborted(f"task {module_path} raised {type(exc).__name__}: {exc}") from exc
    record["return_value"] = value
    _finish(db, timer, task, record, _FIRED)
    return value


def _call(task: Task, timer: Timer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if task.takes_context:
        context = TaskContext(task_result=_to_result(timer, task))
        value = task.call(context, *args, **kwargs)
    else:
        value = task.call(*args, **kwargs)
    try:
        v.check_stored(value, "return value", get_settings().MAX_RESULT_BYTES, "MAX_RESULT_BYTES")
    except PayloadError as exc:
        if "size" in exc.attrs:  # JSON, but too large: stays a ValueError
            raise
        raise TaskPayloadError(str(exc), path=exc.attrs.get("path")) from None
    return value


def _finish(db: str, timer: Timer, task: Task, record: dict[str, Any], state: str) -> None:
    from durable.storage import timers as store

    # Written before the worker completes the timer (in autocommit: external fires run
    # outside any transaction). A crash in between leaves the row firing with this
    # record, and the re-run appends to it.
    if state != _PENDING:
        record["finished_ms"] = current_clock().now_ms()
    store.store_result(db, timer.pk, record)
    # The signal shows what the result reads once the worker commits the completion.
    timer.result, timer.state = record, state
    backend = task.get_backend()
    _signals.task_finished.send(type(backend), task_result=_to_result(timer, task))


def _error(exc: BaseException) -> dict[str, str]:
    text = "".join(traceback.format_exception(exc))
    text = sanitize_error(text, limit=len(text) + 1)  # paths only: stripping never grows it
    if len(text) > MAX_TRACEBACK_CHARS:
        # Keep the end, as Django's backends do: the innermost frames and the
        # "ValueError: message" line are what a reader needs.
        text = "…" + text[-(MAX_TRACEBACK_CHARS - 1) :]
    return {"exception_class_path": _path(type(exc)), "traceback": text}


def _worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


register_kind(TASK_KIND, resolve)
