"""``WorkflowContext``: the ``ctx`` a workflow receives, and the replay rules it enforces.

Every ctx call takes the next sequence number. A recorded call at that number must be
of the same kind and name (else ``NonDeterminismError`` fails the run) and its result is
returned without running anything: a recorded step never runs again (invariant 10). The
first unrecorded call is performed by the backend and recorded; a call that must wait
(sleep, signal, child, step retry) suspends the run by raising ``Suspend``.

Workflow errors (``StepFailed``, ``SignalTimeout``, ``ChildWorkflowFailed``, bad
arguments) are raised into the code, which may catch them. Control flow (suspend, stop,
durable's own failures) is a ``BaseException`` and sticky: any later ctx call (say, in
a ``finally:``) raises it again, so nothing runs past a suspension point.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from durable.core.backoff import Backoff
from durable.core.timeutil import ceil_ms, datetime_to_ms, ms_to_datetime
from durable.dispatch.giveup import Exceptions
from durable.exceptions import (
    ChildWorkflowFailed,
    SignalTimeout,
    WorkflowError,
)
from durable.scheduling.validation import check_delay, check_instant_ms, check_text
from durable.workflows.calls import StepOptions, call_name, check_signal, op, step_failed
from durable.workflows.records import (
    ChildHandle,
    Kind,
    Record,
    Status,
    StepCall,
    StepPolicy,
)
from durable.workflows.replay import ReplayCursor

_SYSTEM_RANDOM = random.SystemRandom()  # never the module's seeded generator


class WorkflowContext(ReplayCursor):
    """The ``ctx`` argument of a workflow: durable steps, sleeps, signals and values.

    Only ctx calls are durable; everything else in a workflow must be deterministic
    given their results, because the worker replays the code from the top each time
    the run resumes. See ``docs/discussions/determinism.md``. The replay rules
    (sequence numbers, recorded calls, sticky interrupts) are
    :class:`~durable.workflows.replay.ReplayCursor`'s.
    """

    # -- the run and the step --------------------------------------------------------------

    @property
    def run_id(self) -> str:
        """The id of the run being executed."""
        return self._run_id

    @property
    def idempotency_key(self) -> str:
        """``"<run id>:<seq>"`` of the step running now (or of the next ctx call).

        The same on every attempt and every replay: pass it to outside services
        (payment APIs, e-mail senders) so a step that runs again is not applied twice.
        """
        seq = self._running_seq if self._running_seq is not None else self._seq
        return f"{self._run_id}:{seq}"

    # -- steps --------------------------------------------------------------------------

    def step(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` once and record its (JSON) result.

        At least once for outside effects: a crash after ``fn`` returned and before its
        record committed runs it again (use :attr:`idempotency_key`). A failure is
        retried with backoff through a durable timer (the run suspends in between);
        after the last attempt, or at once if ``fn`` raises :class:`durable.GiveUp`,
        :class:`~durable.exceptions.StepFailed` is raised here.
        """
        return self._step(Kind.STEP, fn, args, kwargs, None, None, None, None)

    def atomic(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` inside ``transaction.atomic()`` together with writing its record.

        Exactly once for its writes to ``DURABLE["DATABASE"]``: they commit with the
        record or not at all. Writes to any other database are not covered.
        """
        return self._step(Kind.ATOMIC, fn, args, kwargs, None, None, None, None)

    def options(
        self,
        *,
        max_attempts: int | None = None,
        backoff: Backoff | timedelta | None = None,
        name: str | None = None,
        timeout: float | timedelta | None = None,
        retry_on: Any = None,
        give_up_on: Any = None,
    ) -> StepOptions:
        """Step options for one call: ``ctx.options(max_attempts=3).step(fn, ...)``.

        ``name`` replaces the function's qualified name in the history (keep it when
        renaming the function, so running workflows still replay). ``timeout`` (seconds
        or a ``timedelta``; outside steps only) fails an attempt that runs longer with
        ``HandlerTimeout`` (retried like any failure); steps have no deadline otherwise.
        ``retry_on``/``give_up_on`` (exception classes) fail the step at once, with
        ``StepFailed``, as ``@durable.handler``'s do; a step raising ``durable.GiveUp``
        always does.
        """
        return StepOptions.checked(
            self, max_attempts, backoff, name, self._policy.backoff.max_s, timeout,
            (retry_on, give_up_on),
        )  # fmt: skip

    @op
    def _step(
        self,
        kind: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        max_attempts: int | None,
        backoff: Backoff | None,
        name: str | None,
        timeout_s: float | None,
        retry: tuple[Exceptions, Exceptions] = ((), ()),
    ) -> Any:
        if not callable(fn):
            raise TypeError(f"ctx.{kind}(): expected a callable, got {type(fn).__name__}")
        policy = StepPolicy(
            max_attempts=max_attempts or self._policy.max_attempts,
            backoff=backoff or self._policy.backoff,
            timeout_s=timeout_s,
            retry_on=retry[0],
            give_up_on=retry[1],
        )
        seq, prior = self._next(kind, name or call_name(fn))
        if prior is not None:
            if prior.status == Status.DONE:
                return prior.result
            if prior.status == Status.FAILED:
                raise step_failed(prior)
            if prior.wake_ms is not None and self._now() < prior.wake_ms:
                self._suspend(prior)  # a retry that is not due yet
        call = StepCall(
            seq=seq,
            kind=kind,
            name=name or call_name(fn),
            fn=fn,
            args=args,
            kwargs=kwargs,
            policy=policy,
            attempt=(prior.attempts if prior else 0) + 1,
        )
        self._running_seq = seq
        try:
            record = self._call(self._backend.run_step, call)
        finally:
            self._running_seq = None
        if record.status == Status.FAILED:
            raise step_failed(record)
        return record.result

    # -- time ---------------------------------------------------------------------------

    @op
    def sleep(self, delay: timedelta) -> None:
        """Suspend the run for ``delay``; a durable timer wakes it (no thread is held)."""
        ms = check_delay(delay, self._now(), "delay")  # not past MAX_INSTANT either
        self._sleep(lambda now: now + ms)

    @op
    def sleep_until(self, when: datetime) -> None:
        """Suspend the run until the aware datetime ``when`` (at once if it is past)."""
        if not isinstance(when, datetime):
            raise TypeError(f"when: expected an aware datetime, got {type(when).__name__}")
        if when.tzinfo is None or when.utcoffset() is None:
            raise ValueError(f"when: naive datetime {when!r} is ambiguous; use an aware one")
        until = check_instant_ms(datetime_to_ms(when), "when", when)
        self._sleep(lambda now: until)

    def _sleep(self, wake_at: Callable[[int], int]) -> None:
        seq, prior = self._next(Kind.SLEEP, "sleep")
        if prior is None:
            now = self._now()
            wake = wake_at(now)
            record = Record(seq=seq, kind=Kind.SLEEP, name="sleep", result=wake, wake_ms=wake)
            if wake <= now:
                self._call(self._backend.note, record)
                return
            self._suspend(replace(record, status=Status.WAITING))
        assert prior is not None
        if prior.status == Status.DONE:
            return
        if prior.wake_ms is None or self._now() >= prior.wake_ms:
            self._call(self._backend.note, replace(prior, status=Status.DONE))
            return
        self._suspend(prior)

    @op
    def now(self) -> datetime:
        """The current time (aware, UTC), recorded: identical on every replay."""
        seq, prior = self._next(Kind.NOW, "now")
        if prior is None:
            prior = Record(seq=seq, kind=Kind.NOW, name="now", result=self._now())
            self._call(self._backend.note, prior)
        return ms_to_datetime(int(prior.result))

    @op
    def random(self) -> float:
        """A random float in [0, 1), recorded: identical on every replay."""
        seq, prior = self._next(Kind.RANDOM, "random")
        if prior is None:
            prior = Record(seq=seq, kind=Kind.RANDOM, name="random", result=_SYSTEM_RANDOM.random())
            self._call(self._backend.note, prior)
        return float(prior.result)

    @op
    def uuid4(self) -> uuid.UUID:
        """A random UUID, recorded: identical on every replay."""
        seq, prior = self._next(Kind.UUID, "uuid4")
        if prior is None:
            value = str(uuid.UUID(bytes=os.urandom(16), version=4))
            prior = Record(seq=seq, kind=Kind.UUID, name="uuid4", result=value)
            self._call(self._backend.note, prior)
        return uuid.UUID(str(prior.result))

    @op
    def patched(self, change_id: str) -> bool:
        """True where new code runs; False for runs whose history predates the change.

        Temporal's ``patched``: put the new code under ``if ctx.patched("id"):`` and
        keep the old code in the ``else``. A run replaying a history recorded before
        the change finds another call at this seq and gets False (no seq is taken);
        a new run, or one that had not reached this point, records a marker and gets
        True, forever after.
        """
        if not isinstance(change_id, str) or not 1 <= len(change_id) <= 255:
            raise ValueError(f"change_id: expected 1 to 255 characters, got {change_id!r}")
        check_text(change_id, "change_id")
        seq = self._seq
        prior = self._history.get(seq)
        if prior is not None:
            if prior.kind == Kind.PATCHED and prior.name == change_id:
                self._seq += 1
                return True
            return False
        self._seq += 1
        marker = Record(seq=seq, kind=Kind.PATCHED, name=change_id, result=True)
        self._call(self._backend.note, marker)
        return True

    # -- signals and children -------------------------------------------------------------

    @op
    def wait_for_signal(self, name: str, timeout: timedelta | None = None) -> Any:
        """Wait for signal ``name`` and return its payload (oldest first, each used once).

        Signals sent before the wait are kept and taken here. With ``timeout``, raises
        :class:`~durable.exceptions.SignalTimeout` (a ``TimeoutError``) when it passes
        first; the deadline is fixed when the wait first runs.
        """
        check_signal(name, timeout, self._now())
        seq, prior = self._next(Kind.SIGNAL, name)
        if prior is None:
            deadline = None if timeout is None else self._now() + ceil_ms(timeout)
            prior = self._call(self._backend.wait_signal, seq, name, deadline)
        elif prior.status != Status.DONE:
            prior = self._call(self._backend.wait_signal, seq, name, prior.wake_ms)
        result = prior.result or {}
        if result.get("timeout"):
            raise SignalTimeout(
                f"no signal {name!r} before the timeout (seq {seq})", name=name, seq=seq
            )
        return result.get("payload")

    @op
    def start_child(
        self, workflow: Any, /, *args: Any, run_id: str | None = None, **kwargs: Any
    ) -> ChildHandle:
        """Start a child workflow run (idempotently) and return its handle.

        ``workflow`` is a ``@durable.workflow`` function, a ``durable.Workflow``
        subclass or a bound model method (``order.process``). The child's id is
        ``run_id`` or derived from this run's id and the seq, so replay finds it again.
        """
        from durable.workflows.planning import child_id, plan_child

        request = plan_child(workflow, args, kwargs, run_id or child_id(self._run_id, self._seq))
        seq, prior = self._next(Kind.CHILD, request.name)
        if prior is None:
            prior = self._call(self._backend.start_child, seq, request)
        if prior.result.get("error"):
            raise WorkflowError(f"ctx.start_child (seq {seq}): {prior.result['error']}")
        return ChildHandle(str(prior.result["run_id"]))

    @op
    def wait_child(self, handle: ChildHandle | str) -> Any:
        """Wait until a child run finishes; return its result.

        Raises :class:`~durable.exceptions.ChildWorkflowFailed` if it failed or was
        cancelled. The child's completion wakes this run through a timer.
        """
        run_id = handle.run_id if isinstance(handle, ChildHandle) else handle
        if not isinstance(run_id, str):
            raise TypeError(f"handle: expected a ChildHandle or run id, got {handle!r}")
        seq, prior = self._next(Kind.WAIT_CHILD, run_id)
        if prior is None or prior.status != Status.DONE:
            prior = self._call(self._backend.wait_child, seq, run_id)
        outcome = prior.result or {}
        if outcome.get("state") != "completed":
            raise ChildWorkflowFailed(
                f"child run {run_id} {outcome.get('state')}: {outcome.get('error') or '-'}",
                run_id=run_id,
                state=outcome.get("state"),
                error=outcome.get("error", ""),
            )
        return outcome.get("result")

    def child(self, workflow: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Start a child run and wait for its result: ``start_child`` then ``wait_child``."""
        return self.wait_child(self.start_child(workflow, *args, **kwargs))
