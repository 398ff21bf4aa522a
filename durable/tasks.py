"""A Django Tasks backend on durable timers: ``durable.tasks.DurableBackend``.

Works with ``django.tasks`` (Django 6) and with the ``django-tasks`` backport (Django
5.2)::

    TASKS = {"default": {"BACKEND": "durable.tasks.DurableBackend"}}

``task.enqueue(...)`` writes a timer (kind ``task``, target the task's module path) in
the caller's transaction: a rollback leaves nothing, a commit makes it durable, and there
is no ``on_commit`` window in which a crash loses it. ``run_after`` goes through the
timer wheel. The ``run_timer_shards`` worker runs the task outside its batch
transaction (at least once, like ``atomic=False`` handlers) and records its outcome on
the timer row, so ``get_result(result_id)`` works from any process. The result id is the
timer id, as a string, and ``durable.cancel(int(result.id))`` cancels a task not run yet.

The worker looks a timer's module path up in :data:`registry`, which ``@task`` fills
through :meth:`DurableBackend.validate_task` when the worker imports the task's module at
start-up (an app's ``tasks.py``, or ``DURABLE["IMPORTS"]``); it never imports a path
read from a row. Running an attempt and recording it is :mod:`durable.task_worker`.

Backend ``OPTIONS``: ``MAX_ATTEMPTS`` (default 1: a task that raises is ``FAILED``, as
Django's semantics say; more attempts retry with ``DURABLE``'s backoff, and the result
stays ``READY`` in between). The worker runs due tasks by due time, not by priority, so
``supports_priority`` is false and Django rejects a task declared with a non-default
priority (see the how-to).

This module imports durable's models only inside functions: Django loads the backend
when a ``@task`` is declared, and ``check()`` must be able to say that ``durable`` is
missing from ``INSTALLED_APPS`` rather than fail on the import.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.core import checks
from django.db import transaction
from django.utils.module_loading import import_string

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.timeutil import datetime_to_ms, ms_to_datetime
from durable.dispatch.registry import WHERE_TO_REGISTER
from durable.exceptions import PayloadError, UnknownHandler
from durable.scheduling import validation as v

if TYPE_CHECKING:
    from durable.models import Timer

try:  # Django 6
    from django.tasks import exceptions as _exceptions
    from django.tasks import signals as _signals
    from django.tasks.backends.base import BaseTaskBackend

    # TaskContext is used by durable.task_worker, which imports it from here.
    from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
except ImportError:  # Django 5.2 with the django-tasks backport
    from django_tasks import exceptions as _exceptions  # type: ignore[no-redef]
    from django_tasks import signals as _signals  # type: ignore[no-redef]
    from django_tasks.backends.base import BaseTaskBackend  # type: ignore[no-redef]
    from django_tasks.base import (  # type: ignore[no-redef,assignment]
        Task,
        TaskContext,  # noqa: F401  (durable.task_worker)
        TaskError,
        TaskResult,
        TaskResultStatus,
    )

TaskResultDoesNotExist = _exceptions.TaskResultDoesNotExist
# Django 6 names it InvalidTask; the backport InvalidTaskError.
InvalidTaskError: type[Exception] = getattr(
    _exceptions, "InvalidTask", getattr(_exceptions, "InvalidTaskError", ValueError)
)

#: ``Timer.kind`` of task timers (see the lead's TimerKind note in the how-to).
TASK_KIND = "task"
#: Longest traceback kept per attempt (paths stripped, as for ``last_error``); a longer
#: one keeps its end, which holds the innermost frames and the exception's message.
MAX_TRACEBACK_CHARS = 4000

# TimerState's values, spelled out: durable.models is not imported at module level.
_PENDING, _FIRING, _FIRED, _FAILED, _CANCELED = "pending", "firing", "fired", "failed", "canceled"
_STATUS = {
    _PENDING: TaskResultStatus.READY,
    _FIRING: TaskResultStatus.RUNNING,
    _FIRED: TaskResultStatus.SUCCESSFUL,
    _FAILED: TaskResultStatus.FAILED,
    _CANCELED: TaskResultStatus.FAILED,
}


class TaskCanceled(Exception):
    """The task's timer was cancelled (``durable.cancel``) before it ran."""


class TaskPayloadError(PayloadError, TypeError):
    """A task's argument or return value is not JSON.

    Raised by ``enqueue()`` and recorded as the error of a run whose return value is not
    JSON. A ``TypeError``, as Django's Tasks documentation says, and a
    :class:`durable.exceptions.PayloadError` (so a ``ValueError`` too), whose ``path``
    names the offending part (``args[0]``, ``return value['when']``).
    """


class TaskAborted(Exception):
    """A task raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``...).

    The task's result records the original error; the worker is handed this ordinary
    exception (chained from it) and counts a failed attempt, instead of letting
    ``SystemExit`` or ``KeyboardInterrupt`` out of a task into the worker.
    """


class DurableBackend(BaseTaskBackend):
    """Django Tasks backend whose queue is durable's timer table; see the module docstring."""

    supports_defer = True
    supports_get_result = True
    supports_async_task = True
    # Due tasks run in due-time order, not by priority: false, so Django rejects priorities.
    supports_priority = False

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        options = params.get("OPTIONS", {})
        self.max_attempts = v.check_max_attempts(
            options.get("MAX_ATTEMPTS", 1), f"TASKS[{alias!r}]['OPTIONS']", "MAX_ATTEMPTS"
        )
        # Seconds an attempt may run (OPTIONS["TIMEOUT"]); None: HANDLER_TIMEOUT_S.
        try:
            self.timeout_s = v.check_timeout(options.get("TIMEOUT"))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"TASKS[{alias!r}]['OPTIONS']['TIMEOUT']: {exc}") from None

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Write the task's timer in the caller's transaction and return its result handle."""
        from durable.storage import timers as store

        self.validate_task(task)
        _check_importable(task)
        conf = get_settings()
        now_ms = current_clock().now_ms()
        fire_at_ms = now_ms
        if task.run_after is not None:
            fire_at_ms = v.check_instant_ms(
                datetime_to_ms(task.run_after), "run_after", task.run_after
            )
        args, kwargs = _check_arguments(args, kwargs, conf.MAX_PAYLOAD_BYTES)
        # Django does not check the arguments against the function: a call that cannot
        # bind would fail every attempt in the worker.
        leading = (None,) if task.takes_context else ()
        v.check_binds(
            v.call_shape(task.func), f"task {task.module_path}", (*leading, *args), kwargs
        )
        timer = store.new_pending(
            conf,
            fire_at_ms=fire_at_ms,
            kind=TASK_KIND,
            target=task.module_path,
            args=args,
            kwargs=kwargs,
            max_attempts=self.max_attempts,
            backoff_base_s=conf.BACKOFF_BASE_S,
            backoff_max_s=conf.BACKOFF_MAX_S,
            # context is only read by on_complete, which task timers never have.
            context={
                "backend": self.alias,
                "queue_name": task.queue_name,
                "priority": task.priority,
                "run_after_ms": None if task.run_after is None else fire_at_ms,
            },
        )
        db = conf.DATABASE
        with transaction.atomic(using=db, savepoint=False):
            timer, _ = store.insert_timer(db, timer)
            store.announce(db, [timer], now_ms)
        result = _to_result(timer, task)
        _signals.task_enqueued.send(type(self), task_result=result)
        return result

    def validate_task(self, task: Task) -> None:
        """Django's checks, then register ``task``: Django calls this when a Task is made.

        ``@task`` runs it at import, so importing a task's module (the worker's start-up
        does, see :mod:`durable.discovery`) registers the task for the worker to run.
        """
        super().validate_task(task)
        registry.register(task)

    def get_result(self, result_id: str) -> TaskResult:
        """Return the stored result of ``result_id``; raise ``TaskResultDoesNotExist``."""
        timer = _load(result_id)
        try:
            task = _task_of(timer)
        except UnknownHandler as exc:
            raise TaskResultDoesNotExist(f"task result {timer.pk}: {exc}") from None
        return _to_result(timer, task)

    def check(self, **kwargs: Any) -> Any:
        """Report ``durable.E030`` if ``durable`` is not in ``INSTALLED_APPS``.

        DURABLE's own system checks cover its database and settings once it is installed.
        """
        if apps.is_installed("durable"):
            return []
        return [
            checks.Error(
                f"TASKS[{self.alias!r}] uses durable.tasks.DurableBackend, but 'durable' is "
                "not in INSTALLED_APPS",
                hint="Add 'durable' to INSTALLED_APPS and run migrate: tasks are rows in "
                "durable's timer table.",
                id="durable.E030",
            )
        ]


def _check_importable(task: Task) -> None:
    """The worker finds the task by its module path: make sure that path leads back to it."""
    try:
        found = import_string(task.module_path)
    except ImportError:
        found = None
    if getattr(found, "func", None) is not task.func:
        raise InvalidTaskError(
            f"task {task.module_path!r} is not importable by that path: define it at module "
            "level with @task, under the function's own name"
        )


def _load(result_id: Any) -> Timer:
    from durable.storage import timers as store

    try:
        timer_id = int(result_id)
    except (TypeError, ValueError):
        raise TaskResultDoesNotExist(f"no task result {result_id!r}") from None
    timer = store.get_timer(get_settings().DATABASE, timer_id, kind=TASK_KIND)
    if timer is None:
        raise TaskResultDoesNotExist(f"no task result {result_id!r}")
    return timer


class TaskRegistry:
    """Module path → the ``Task`` defined there, for tasks on a :class:`DurableBackend`.

    Filled by :meth:`DurableBackend.validate_task` as ``@task`` runs. A timer's target
    (the module path) is row data: it is looked up here, never imported.
    """

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}
        self._lock = threading.Lock()

    def register(self, task: Task) -> None:
        """Remember ``task`` under its module path (variants made by ``using()`` are not kept)."""
        with self._lock:
            found = self._tasks.get(task.module_path)
            if found is None or found.func is not task.func:
                self._tasks[task.module_path] = task

    def get(self, module_path: str) -> Task | None:
        """The Task registered under ``module_path``, or ``None``."""
        return self._tasks.get(module_path)

    def resolve(self, module_path: str) -> Task:
        """The Task registered under ``module_path``; raise :class:`UnknownHandler`.

        Outside the worker a task's module may not be imported yet: the conventional
        modules are imported once (:func:`durable.discovery.discover_once`), then the
        name is looked up again. Nothing named by the row itself is imported.
        """
        task = self._tasks.get(module_path)
        if task is None:
            from durable.discovery import discover_once

            discover_once()
            task = self._tasks.get(module_path)
        if task is None:
            raise UnknownHandler(
                f"unknown task {module_path!r}: it is not registered (no @task of that name on a "
                f"DurableBackend was imported at start-up); {WHERE_TO_REGISTER}",
                handler=module_path,
            )
        return task


#: Every task of a :class:`DurableBackend`, by module path (the worker reads it).
registry = TaskRegistry()


def _task_of(timer: Timer) -> Task:
    """The Task a timer runs, with the options it was enqueued with."""
    task = registry.resolve(timer.target)
    context = timer.context or {}
    run_after = context.get("run_after_ms")
    return task.using(  # type: ignore[no-any-return]
        priority=context.get("priority"),
        queue_name=context.get("queue_name"),
        backend=context.get("backend"),
        run_after=None if run_after is None else ms_to_datetime(run_after),
    )


def _to_result(timer: Timer, task: Task) -> TaskResult:
    record = timer.result if isinstance(timer.result, dict) else {}
    errors = [TaskError(**error) for error in record.get("errors", [])]
    status = _STATUS[timer.state]
    if timer.state == _CANCELED:
        errors.append(TaskError(exception_class_path=_path(TaskCanceled), traceback="canceled"))
    finished = None
    if timer.state in (_FIRED, _FAILED):
        finished = timer.fired_at or _when(record.get("finished_ms"))
    result = TaskResult(
        task=task,
        id=str(timer.pk),
        status=status,
        enqueued_at=timer.created_at,
        started_at=_when(record.get("started_ms")),
        finished_at=finished or (timer.updated_at if timer.state == _CANCELED else None),
        last_attempted_at=_when(record.get("attempted_ms")),
        args=timer.args,
        kwargs=timer.kwargs,
        backend=(timer.context or {}).get("backend", task.backend),
        errors=errors,
        worker_ids=list(record.get("worker_ids", [])),
    )
    if "return_value" in record:
        object.__setattr__(result, "_return_value", record["return_value"])
    return result


def _when(ms: int | None) -> datetime | None:
    return None if ms is None else ms_to_datetime(ms)


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _check_arguments(args: Any, kwargs: Any, max_bytes: int) -> tuple[list[Any], dict[str, Any]]:
    try:
        return v.check_payload(list(args), dict(kwargs), None, max_bytes)
    except PayloadError as exc:
        if "size" in exc.attrs:  # JSON, but too large: stays a ValueError
            raise
        # Django's own backends say "Unsupported type" (its tests match on it); ours also
        # names the argument and the value.
        raise TaskPayloadError(
            f"Unsupported type or value: {exc}", path=exc.attrs.get("path")
        ) from None


# The worker side (the "task" kind's resolver and one attempt of a task) is
# durable.task_worker; importing it registers the kind. It imports this module's
# names, so it comes last.
from durable import task_worker  # noqa: E402,F401
