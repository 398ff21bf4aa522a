"""The exception tree. Every error durable raises on purpose is a ``DurableError``.

Errors carry structured attributes (Temporal's habit) so callers and logs can act on
them without parsing messages; the class docstring is the default message.
"""

from __future__ import annotations

from typing import Any


class DurableError(Exception):
    """A durable operation failed."""

    def __init__(self, message: str | None = None, **attrs: Any) -> None:
        self.attrs = attrs
        for key, value in attrs.items():
            setattr(self, key, value)
        super().__init__(message or (self.__doc__ or "").strip())


class TimerError(DurableError):
    """A timer could not be scheduled, cancelled or fired."""


class UnknownHandler(TimerError):
    """No handler is registered under that name."""


class AttemptsExhausted(TimerError):
    """Every attempt of the timer started and none finished (the worker died or hung)."""


class HandlerTimeout(TimerError):
    """The handler ran past its ``timeout`` and was abandoned; the attempt failed."""


class HandlerAborted(TimerError):
    """The handler raised a ``BaseException`` (``SystemExit``, ``KeyboardInterrupt``, ...).

    The worker counts it as a failed attempt of that timer and lives on; the original
    exception is chained as ``__cause__``.
    """

    @classmethod
    def contain(cls, exc: BaseException) -> Exception:
        """``exc`` if it is an ``Exception``, else a ``HandlerAborted`` chained to it: what
        a handler raised, made something that fails an attempt and not the worker."""
        if isinstance(exc, Exception):
            return exc
        aborted = cls(f"the handler raised {type(exc).__name__}: {exc}")
        aborted.__cause__ = exc
        return aborted


# Also a ValueError, so code that already catches bad values handles it. Attributes:
# ``path`` names the offending part (``args[1]['when']``); ``size`` and ``limit`` are set
# when the payload is too large.
class PayloadError(TimerError, ValueError):
    """A payload is not JSON-serializable or is too large."""


class GiveUp(DurableError):
    """The work failed for good: do not retry it.

    Raise it from a handler, a workflow step or a Django task to fail at once, whatever
    attempts are left: the timer is dead-lettered (its ``on_complete`` follow-up gets
    ``{"status": "failed", ...}``), the step fails (``StepFailed`` reaches the workflow
    code), the task's result is ``FAILED``. ``cause`` (optional) is the exception that
    made it final; it is also chained as ``__cause__``. ``GiveUp(cause=exc)`` without a
    message says ``"<type of exc>: <exc>"``.
    """

    def __init__(self, message: str | None = None, *, cause: BaseException | None = None) -> None:
        if message is None:  # the cause's words, else the docstring's first line
            first = (type(self).__doc__ or "").strip().splitlines()[:1]
            message = f"{type(cause).__name__}: {cause}" if cause is not None else "".join(first)
        super().__init__(message, cause=cause)
        if cause is not None:
            self.__cause__ = cause


class ShardError(DurableError):
    """A shard lease operation failed."""


class LeaseLost(ShardError):
    """This worker no longer holds the shard's lease (its fencing token is stale)."""


class ScheduleError(DurableError):
    """A cron or interval schedule is invalid."""


class WorkflowError(DurableError):
    """A workflow run failed or was misused."""


class NonDeterminismError(WorkflowError):
    """Replay found a different call than the one recorded at this sequence number."""


class StepFailed(WorkflowError):
    """A workflow step exhausted its attempts."""


class UnknownWorkflow(WorkflowError):
    """No workflow is registered under that name, or no run has that id."""


# Also a TimeoutError, so ``except TimeoutError`` in workflow code catches it.
class SignalTimeout(WorkflowError, TimeoutError):
    """``ctx.wait_for_signal`` reached its timeout before the signal arrived."""


class ChildWorkflowFailed(WorkflowError):
    """A child workflow awaited with ``ctx.wait_child`` failed or was cancelled."""
