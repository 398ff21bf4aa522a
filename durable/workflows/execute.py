"""Run workflow code once against a context and say how it ended. Pure: no database.

Used by the worker (with the database backend) and by golden-history replays (with a
backend that performs nothing). The code either returns (completed), raises (failed),
or stops at a ctx call that must wait (suspended). Durable's own failures and a stop
(the run was cancelled under us) are not outcomes: they propagate to the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from durable.conf import get_settings
from durable.exceptions import NonDeterminismError, PayloadError, WorkflowError
from durable.scheduling.validation import check_stored
from durable.workflows.context import WorkflowContext
from durable.workflows.records import Abort, RunStopped, Suspend

COMPLETED = "completed"
FAILED = "failed"
SUSPENDED = "suspended"


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """How one execution of workflow code ended."""

    state: str
    """``completed``, ``failed`` or ``suspended``."""
    result: Any = None
    error: BaseException | None = None


def execute(ctx: WorkflowContext, code: Callable[[WorkflowContext], Any]) -> Outcome:
    """Call ``code(ctx)`` under the context's rules and return its :class:`Outcome`.

    Raises the original error when durable's machinery failed (``Abort``) and
    :class:`RunStopped` when the run was stopped while the code ran.
    """
    error: Exception | None = None
    value: Any = None
    ctx.enter_code()
    try:
        value = code(ctx)
    except (Suspend, RunStopped, Abort):
        pass  # recorded on the context; examined below, whatever the code did after
    except Exception as exc:
        error = exc
    finally:
        ctx.leave_code()
    interrupt = ctx.interrupt
    if isinstance(interrupt, Abort):
        raise interrupt.error
    if isinstance(interrupt, RunStopped):
        raise interrupt
    if isinstance(interrupt, Suspend):
        return Outcome(state=SUSPENDED)
    if ctx.failure is not None:
        return Outcome(state=FAILED, error=ctx.failure)
    if error is not None:
        return Outcome(state=FAILED, error=error)
    return _completed(ctx, value)


def _completed(ctx: WorkflowContext, value: Any) -> Outcome:
    leftover = ctx.unconsumed()
    if leftover is not None:
        error = NonDeterminismError(
            f"seq {leftover.seq}: the history recorded {leftover.kind} {leftover.name!r} "
            "but the code now returns before making that call",
            seq=leftover.seq,
            recorded=f"{leftover.kind} {leftover.name}",
            found="return",
        )
        return Outcome(state=FAILED, error=error)
    try:
        check_stored(value, "result", get_settings().MAX_RESULT_BYTES, "MAX_RESULT_BYTES")
    except PayloadError as exc:
        what = "too large" if "size" in exc.attrs else "not JSON"
        error = WorkflowError(f"the workflow returned a value that is {what}: {exc}")
        return Outcome(state=FAILED, error=error)
    return Outcome(state=COMPLETED, result=value)
