"""``@durable.handler``: declare a module-level function as something a timer can fire."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, overload

from durable.conf import get_settings
from durable.dispatch import concurrency
from durable.dispatch.giveup import check_exceptions
from durable.dispatch.registry import HandlerSpec, handler_name, handlers
from durable.exceptions import ScheduleError
from durable.scheduling.validation import check_max_attempts, check_timeout, to_backoff

F = TypeVar("F", bound=Callable[..., Any])


@overload
def handler(fn: F, /) -> F: ...


@overload
def handler(
    *,
    atomic: bool = True,
    max_attempts: int | None = None,
    backoff: Any = None,
    timeout: float | timedelta | None = None,
    retry_on: Any = None,
    give_up_on: Any = None,
    concurrency_key: Any = None,
    max_concurrency: int | None = None,
    rate_limit: str | None = None,
) -> Callable[[F], F]: ...


def handler(
    fn: Any = None,
    /,
    *,
    atomic: bool = True,
    max_attempts: int | None = None,
    backoff: Any = None,
    timeout: float | timedelta | None = None,
    retry_on: Any = None,
    give_up_on: Any = None,
    concurrency_key: Any = None,
    max_concurrency: int | None = None,
    rate_limit: str | None = None,
) -> Any:
    """Register a module-level function as a timer handler; return it unchanged.

    Use bare (``@durable.handler``) or with options
    (``@durable.handler(atomic=False, max_attempts=5, backoff=timedelta(seconds=30))``):

    - ``atomic=True`` (default): the handler runs inside the transaction that marks its
      timer fired, so its effect on the database happens exactly once.
    - ``atomic=False``: for outside effects (HTTP calls, e-mail); at-least-once, use
      ``durable.current_fire().idempotency_key`` to deduplicate.
    - ``max_attempts``: attempts before the timer is dead-lettered (default
      ``DURABLE["MAX_ATTEMPTS"]``); ``backoff``: a :class:`durable.Backoff`, or a
      ``timedelta`` base delay capped by ``DURABLE["BACKOFF_MAX_S"]``.
    - ``timeout``: seconds (or a ``timedelta``) an attempt may run; past it the attempt
      fails (an atomic handler is interrupted, an external one abandoned on its thread).
      Default ``DURABLE["ATOMIC_TIMEOUT_S"]`` (5 s) for atomic handlers and
      ``DURABLE["HANDLER_TIMEOUT_S"]`` (240 s) for the others.
    - ``retry_on``/``give_up_on``: an ``Exception`` subclass or a tuple of them. An
      exception matching ``give_up_on``, or (when ``retry_on`` is given) matching none
      of ``retry_on``, dead-letters the timer at once, its other attempts unused;
      ``give_up_on`` wins when both match. Raising :class:`durable.GiveUp` always does.
      Timeouts and ``BaseException`` subclasses are retried unless ``give_up_on`` names
      ``HandlerTimeout``/``HandlerAborted``.
    - ``concurrency_key`` and ``max_concurrency`` (together): at most ``max_concurrency``
      attempts of this handler run at once per key, across the cluster. The key is a
      fixed ``str`` or a callable given the call's arguments that returns one
      (evaluated by ``schedule()``). Timers over the limit wait, in the order they came
      due, and the oldest is made due when a running one finishes (docs: how-to
      "Limit concurrency and rate per key").
    - ``rate_limit`` (with ``concurrency_key``): ``"N/s"``, ``"N/m"`` or ``"N/h"``, at
      most N attempts start per key in any window of that length, across the cluster;
      the others wait in the same line, the first due when the window has room.

    Bad options raise ``TypeError``/``ValueError`` naming the argument, at decoration time.
    """
    if not isinstance(atomic, bool):
        raise TypeError(f"atomic: expected True or False, got {type(atomic).__name__}")
    check_max_attempts(max_attempts)
    timeout_s = check_timeout(timeout)
    retry = check_exceptions(retry_on, "retry_on")
    give_up = check_exceptions(give_up_on, "give_up_on")
    limit = concurrency.policy(concurrency_key, max_concurrency, rate_limit)
    # Settings are read only for a timedelta: decorators run at import, and a handler
    # module should not need configured settings unless it asks for them.
    policy = to_backoff(backoff, get_settings().BACKOFF_MAX_S) if backoff is not None else None

    def register(func: F) -> F:
        _check_function(func)
        if limit is not None:
            _check_not_scheduled(func)
        spec = HandlerSpec(
            name=handler_name(func),
            fn=func,
            atomic=atomic,
            max_attempts=max_attempts,
            backoff=policy,
            timeout=timeout_s,
            retry_on=retry,
            give_up_on=give_up,
            concurrency=limit,
        )
        handlers.register(spec)
        return func

    if fn is None:
        return register
    return register(fn)


def _check_function(func: Any) -> None:
    # Only plain functions are importable by the worker under a stable dotted name and
    # callable without an instance; async ones would return an un-awaited coroutine.
    if not inspect.isfunction(func):
        raise TypeError(
            f"@durable.handler decorates module-level functions, got {type(func).__name__} "
            f"{func!r} (did you mean @durable.handler(...) with keyword arguments?)"
        )
    if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
        raise TypeError(f"handler {func.__qualname__!r} is async; handlers must be sync functions")


def _check_not_scheduled(func: Any) -> None:
    # @durable.cron/@durable.every applied first (under this decorator): a schedule would
    # call the function outside its key's limits (the other order is refused by the
    # schedule's own check, durable.scheduling.callables.check_unlimited).
    from durable.scheduling.cron import functions

    path = handler_name(func)
    if functions.get(path) is not None:
        raise ScheduleError(
            f"@durable.handler on {path}: concurrency_key: the function is declared as a "
            "schedule (@durable.cron / @durable.every), which calls it directly, outside "
            "the key's limits; schedule a function that calls durable.schedule("
            f"{func.__name__}, ...) instead, whose timers wait in the key's line",
            field="handler",
            check_id="durable.E016",
        )
