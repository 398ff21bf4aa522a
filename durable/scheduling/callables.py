"""The function a schedule calls, and the keyword arguments it is called with: checks.

A schedule calls ``fn(occurrence, **kwargs)``. Both halves are checked when the schedule
is declared (decorator, ``DURABLE["CRONS"]``, ``durable.schedules``), so that a mistake
is a ``ScheduleError`` at import or at the call, never a failed run at 3 a.m.
"""

from __future__ import annotations

import inspect
from typing import Any

from durable.exceptions import PayloadError, ScheduleError, UnknownHandler

__all__ = [
    "check_binding",
    "check_kwargs",
    "check_stored_binding",
    "check_unlimited",
    "handler_path",
]


def check_kwargs(kwargs: Any) -> dict[str, Any]:
    """``kwargs`` as a new dict; ``ScheduleError`` (E018) unless a JSON object within the cap.

    The cap is ``DURABLE["MAX_PAYLOAD_BYTES"]``, as for a timer's payload.
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise _fail(
            f"kwargs: expected a dict of JSON values, got {type(kwargs).__name__}",
            "durable.E018",
            "kwargs",
        )
    if not kwargs:
        return {}
    from durable.conf import get_settings  # only when there are kwargs: see handlers.py
    from durable.scheduling.validation import check_payload

    try:
        check_payload([], kwargs, None, get_settings().MAX_PAYLOAD_BYTES)
    except PayloadError as exc:
        size = exc.attrs.get("size")
        text = str(exc)  # "kwargs['when']: ..." names the part that is not JSON
        if size is not None:
            text = (
                f"kwargs: {size} bytes of JSON; the limit is "
                f"DURABLE['MAX_PAYLOAD_BYTES'] = {exc.attrs['limit']}"
            )
        raise _fail(text, "durable.E018", "kwargs") from None
    return dict(kwargs)


def handler_path(
    handler: Any, *, registered: bool = False, kwargs: dict[str, Any] | None = None
) -> str:
    """Return the dotted path of a schedule's function, checking it can be called by it.

    The function must be a module-level, synchronous function that accepts the
    :class:`Occurrence` as its one positional argument, plus ``kwargs`` as keyword
    arguments; a dotted path must import to such a function. The path comes from code
    (a decorator, ``CRONS``, a caller of ``durable.schedules``), never from a row, so
    importing it is fine. With ``registered``, the function must also be one the worker
    can find by name: declared with ``@durable.cron`` or ``@durable.every``, named in
    ``CRONS``, or decorated with ``@durable.handler``. Raises ``ScheduleError``
    (``durable.E016``, or ``E018`` when ``kwargs`` do not bind) starting ``handler:``
    or ``kwargs:``; ``kwargs=None`` leaves out the check of the keyword arguments.
    """
    fn = _import(handler) if isinstance(handler, str) else handler
    if not inspect.isfunction(fn):
        raise _fail(f"handler: expected a module-level function, got {type(fn).__name__}")
    path = f"{fn.__module__}.{fn.__qualname__}"
    if "<locals>" in path or "<lambda>" in path:
        raise _fail(f"handler: {path} is not importable by name; define it at module level")
    if inspect.iscoroutinefunction(fn):
        raise _fail(f"handler: {path} is async")
    check_binding(fn, path, kwargs)
    check_unlimited(path)
    if registered:
        _check_registered(handler if isinstance(handler, str) else path)
    return handler if isinstance(handler, str) else path


def check_binding(fn: Any, path: str, kwargs: dict[str, Any] | None) -> None:
    """Raise ``ScheduleError`` unless ``fn(occurrence, **kwargs)`` binds to its signature.

    ``kwargs=None`` (they were refused already) checks the occurrence argument only.
    """
    signature = inspect.signature(fn)
    try:
        signature.bind_partial(None)
    except TypeError:
        raise _fail(
            f"handler: {path} must accept one positional argument (the occurrence)"
        ) from None
    if kwargs is None:
        return
    try:
        signature.bind(None, **kwargs)
    except TypeError as exc:
        if not kwargs:
            raise _fail(
                f"handler: {path}(occurrence) cannot be called: {exc}; pass the other "
                "arguments with kwargs="
            ) from None
        raise _fail(
            f"kwargs: {path}(occurrence, **kwargs) does not accept kwargs "
            f"{', '.join(map(repr, sorted(kwargs)))}: {exc}",
            "durable.E018",
            "kwargs",
        ) from None


def check_stored_binding(path: str, kwargs: dict[str, Any]) -> None:
    """New kwargs for a stored function: they must bind, if this process knows it.

    The stored path is looked up, never imported (it is row data). A function this
    process has not registered (a ``CRONS`` entry outside the worker) is not checked
    here; a run whose kwargs do not bind is recorded as failed.
    """
    from durable.scheduling.cron import schedule_function

    try:
        fn = schedule_function(path)
    except UnknownHandler:
        return
    check_binding(fn, path, kwargs)


def check_unlimited(path: str) -> None:
    """Raise ``ScheduleError`` (``durable.E016``) if ``path`` is a limited handler.

    A schedule calls its function directly (``fn(occurrence, **kwargs)``), outside any
    concurrency key's line: a ``@durable.handler`` declared with ``concurrency_key``
    (``max_concurrency``, ``rate_limit``) would run over its limits. The way to run a
    limited handler on a schedule is a plain schedule function that calls
    ``durable.schedule(handler, ...)``: its timers wait in the key's line.
    """
    from durable.dispatch.registry import handlers

    spec = handlers.get(path)
    if spec is not None and spec.concurrency is not None:
        raise _fail(
            f"handler: {path} is declared with @durable.handler(concurrency_key=...): a "
            "schedule would call it directly, outside its key's limits; schedule a "
            f"function that calls durable.schedule({path.rsplit('.', 1)[-1]}, ...) instead, "
            "whose timers wait in the key's line"
        )


def _fail(message: str, check_id: str = "durable.E016", field: str = "handler") -> ScheduleError:
    return ScheduleError(message, field=field, check_id=check_id)


def _check_registered(path: str) -> None:
    from durable.scheduling.cron import schedule_function

    try:
        schedule_function(path)
    except UnknownHandler as exc:
        raise _fail(f"handler: {exc}") from None


def _import(path: str) -> Any:
    from django.utils.module_loading import import_string

    try:
        return import_string(path)
    except ImportError as exc:
        raise _fail(f"handler: cannot import {path!r} ({exc})") from None
