"""The replay rules every ctx call goes through: sequence numbers and the recorded history.

:class:`ReplayCursor` is the base of :class:`~durable.workflows.context.WorkflowContext`.
Each ctx call takes the next sequence number (:meth:`ReplayCursor._next`); a recorded
call at that number must be of the same kind and name, or ``NonDeterminismError`` fails
the run. A suspension, a stop or durable's own failure is kept and raised again by any
later call (:meth:`ReplayCursor._check_live`), and an error of the backend becomes
``Abort`` (:meth:`ReplayCursor._call`), not the workflow's to catch. It also answers the
executor: how the replay ended, and which recorded call the code did not make.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from durable.exceptions import NonDeterminismError, WorkflowError
from durable.workflows.guard import StrictGuard
from durable.workflows.records import (
    Abort,
    Backend,
    Interrupt,
    Record,
    StepPolicy,
    too_many_steps,
)


class ReplayCursor:
    """Where a replay is in a run's history, and how it ended (see the module docstring)."""

    def __init__(
        self,
        *,
        run_id: str,
        history: list[Record],
        backend: Backend,
        policy: StepPolicy,
        strict: bool = False,
    ) -> None:
        self._run_id = run_id
        self._history = {record.seq: record for record in history}
        self._backend = backend
        self._policy = policy
        self._seq = 0
        self._running_seq: int | None = None
        self._depth = 0
        self._interrupt: Interrupt | None = None
        self._failure: WorkflowError | None = None
        self._guard = StrictGuard(self._keep_failure) if strict else None

    # -- what the executor needs --------------------------------------------------------

    @property
    def failure(self) -> WorkflowError | None:
        """A non-determinism error seen during this replay (it fails the run)."""
        return self._failure

    @property
    def interrupt(self) -> Interrupt | None:
        """The suspension or stop that ended this replay, if any."""
        return self._interrupt

    def enter_code(self) -> None:
        """Arm strict mode (if on) before the workflow code starts."""
        if self._guard is not None:
            self._guard.arm()

    def leave_code(self) -> None:
        """Disarm strict mode once the workflow code returned or raised."""
        if self._guard is not None:
            self._guard.disarm()

    def unconsumed(self) -> Record | None:
        """The first recorded call the code did not make this time (None if all were)."""
        later = [seq for seq in self._history if seq >= self._seq]
        return self._history[min(later)] if later else None

    # -- machinery ----------------------------------------------------------------------

    def _check_live(self) -> None:
        if self._interrupt is not None:
            raise self._interrupt
        if self._failure is not None:
            raise self._failure

    def _keep_failure(self, error: WorkflowError) -> None:
        self._failure = self._failure or error

    def _next(self, kind: str, name: str) -> tuple[int, Record | None]:
        seq = self._seq
        if seq >= self._policy.max_steps:  # every replay reads the whole history
            failure = too_many_steps(seq, self._policy.max_steps)
            self._keep_failure(failure)
            raise failure
        self._seq += 1
        prior = self._history.get(seq)
        if prior is not None and (prior.kind, prior.name) != (kind, name):
            error = NonDeterminismError(
                f"seq {seq}: the history recorded {prior.kind} {prior.name!r} but the code "
                f"now calls {kind} {name!r}",
                seq=seq,
                recorded=f"{prior.kind} {prior.name}",
                found=f"{kind} {name}",
            )
            self._keep_failure(error)
            raise error
        return seq, prior

    def _now(self) -> int:
        return int(self._call(self._backend.now_ms))

    def _suspend(self, record: Record) -> None:
        self._call(self._backend.suspend, record)
        raise AssertionError("backend.suspend() returned instead of suspending")

    def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except Interrupt:
            raise
        except Exception as exc:  # durable's own failure: not the workflow's to catch
            raise Abort(exc) from exc
