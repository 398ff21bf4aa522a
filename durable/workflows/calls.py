"""Pieces of the ctx API that are not the context itself: names, options, the op wrapper.

``op`` wraps every public ctx call: while durable's own code runs, strict mode's guard
is off (the ORM reads the clock), and an interrupt raised inside is remembered, so any
later ctx call raises it again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from durable.core.backoff import Backoff
from durable.dispatch.giveup import Exceptions, check_exceptions
from durable.exceptions import StepFailed
from durable.scheduling.validation import (
    check_delay,
    check_max_attempts,
    check_text,
    check_timeout,
    to_backoff,
)
from durable.workflows.records import Interrupt, Kind, Record

if TYPE_CHECKING:
    from durable.workflows.context import WorkflowContext

T = TypeVar("T", bound=Callable[..., Any])
MAX_SIGNAL_NAME = 200


def check_signal(name: Any, timeout: Any = None, now_ms: int = 0) -> None:
    """Raise ``ValueError``/``TypeError`` naming the bad argument of a signal call.

    A ``timeout`` must be a positive timedelta whose deadline (from ``now_ms``) is not
    past ``MAX_INSTANT``.
    """
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_SIGNAL_NAME:
        raise ValueError(f"name: expected 1 to {MAX_SIGNAL_NAME} characters, got {name!r}")
    check_text(name, "name")
    if timeout is not None:
        check_delay(timeout, now_ms, "timeout", positive=True)


def call_name(fn: Any) -> str:
    """The name a step is recorded under: the function's qualified name."""
    inner = getattr(fn, "func", fn)  # functools.partial
    inner = getattr(inner, "__func__", inner)  # bound methods
    return str(getattr(inner, "__qualname__", None) or type(inner).__name__)


def op(method: T) -> T:
    """Wrap a public ctx call: leave workflow code (strict guard off) and keep interrupts."""

    @functools.wraps(method)
    def wrapper(self: WorkflowContext, *args: Any, **kwargs: Any) -> Any:
        outermost = self._depth == 0
        if outermost and self._guard is not None:
            self._guard.disarm()
        self._depth += 1
        try:
            self._check_live()
            return method(self, *args, **kwargs)
        except Interrupt as interrupt:
            self._interrupt = self._interrupt or interrupt
            raise
        finally:
            self._depth -= 1
            if outermost and self._guard is not None and self._interrupt is None:
                self._guard.arm()

    return wrapper  # type: ignore[return-value]


class StepOptions:
    """``ctx.options(...)``: the same ``step``/``atomic`` with per-call retry policy or name."""

    __slots__ = ("_backoff", "_ctx", "_max_attempts", "_name", "_retry", "_timeout")

    def __init__(
        self,
        ctx: WorkflowContext,
        max_attempts: int | None,
        backoff: Backoff | None,
        name: str | None,
        timeout: float | None = None,
        retry: tuple[Exceptions, Exceptions] = ((), ()),
    ) -> None:
        self._ctx = ctx
        self._max_attempts = max_attempts
        self._backoff = backoff
        self._name = name
        self._timeout = timeout
        self._retry = retry  # (retry_on, give_up_on), validated

    @classmethod
    def checked(
        cls,
        ctx: WorkflowContext,
        max_attempts: Any,
        backoff: Any,
        name: Any,
        max_s: float,
        timeout: Any = None,
        retry: tuple[Any, Any] = (None, None),
    ) -> StepOptions:
        """Validate the options (errors name the argument) and bind them to ``ctx``.

        ``retry``: the ``(retry_on, give_up_on)`` arguments, as passed.
        """
        check_max_attempts(max_attempts)
        policy = to_backoff(backoff, max(max_s, 1.0))
        if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 255):
            raise ValueError(f"name: expected 1 to 255 characters, got {name!r}")
        check_text(name, "name")
        checked = (
            check_exceptions(retry[0], "retry_on"),
            check_exceptions(retry[1], "give_up_on"),
        )
        return cls(ctx, max_attempts, policy, name, check_timeout(timeout), checked)

    def step(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`WorkflowContext.step` with these options."""
        opts = (self._max_attempts, self._backoff, self._name, self._timeout, self._retry)
        return self._ctx._step(Kind.STEP, fn, args, kwargs, *opts)

    def atomic(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`WorkflowContext.atomic` with these options."""
        opts = (self._max_attempts, self._backoff, self._name, self._timeout, self._retry)
        return self._ctx._step(Kind.ATOMIC, fn, args, kwargs, *opts)


def step_failed(record: Record) -> StepFailed:
    return StepFailed(
        f"step {record.name!r} (seq {record.seq}) failed after {record.attempts} "
        f"attempt(s): {record.error}",
        seq=record.seq,
        name=record.name,
        attempts=record.attempts,
        error=record.error,
    )
