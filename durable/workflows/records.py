"""The vocabulary of replay: history records, call kinds, interrupts and the backend seam.

A run's history is a list of :class:`Record`, one per ctx call, numbered by ``seq`` in
the order the workflow code makes them. :class:`~durable.workflows.context.WorkflowContext`
matches each call against the record at its seq and asks a :class:`Backend` to perform
the calls that are not recorded yet. The worker's backend writes to the database; the
golden-history replayer's backend refuses to do anything live; the in-memory backend
(tests) simulates both. This module is pure: no Django, no ORM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from durable.core.backoff import Backoff
from durable.dispatch.giveup import gives_up
from durable.exceptions import WorkflowError


class Kind:
    """What a ctx call was; recorded and checked on replay."""

    STEP = "step"
    ATOMIC = "atomic"
    SLEEP = "sleep"
    SIGNAL = "signal"
    CHILD = "child"
    WAIT_CHILD = "wait_child"
    NOW = "now"
    RANDOM = "random"
    UUID = "uuid4"
    PATCHED = "patched"


class Status:
    """Where a recorded call stands."""

    DONE = "done"
    FAILED = "failed"  # a step out of attempts: replays as StepFailed
    RETRYING = "retrying"  # a step attempt failed; the next is due at wake_ms
    WAITING = "waiting"  # a sleep, signal wait or child wait not over yet


@dataclass(frozen=True, slots=True, kw_only=True)
class Record:
    """One recorded ctx call: the unit of a run's history."""

    seq: int
    kind: str
    name: str
    status: str = Status.DONE
    result: Any = None
    error: str = ""
    attempts: int = 0
    wake_ms: int | None = None
    """Sleep end, signal-wait deadline, or when a retrying step's next attempt is due."""
    started_ms: int | None = field(default=None, compare=False)
    """When this attempt of a step began (``ctx.step``/``ctx.atomic`` run live only).
    Not part of the history: replay never reads it, and records compare without it."""
    duration_ms: int | None = field(default=None, compare=False)
    """How long this attempt of a step ran (with :attr:`started_ms`)."""

    def row(self) -> dict[str, Any]:
        """This record's fields as a dict (the step row's columns but the run).

        Shallow, unlike ``dataclasses.asdict``: a result is JSON and never changed
        once recorded, and a deep copy of it per checkpoint showed in the step's cost.
        The attempt's times (``started_ms``, ``duration_ms``) are keys only when known:
        only steps run live have them, and the storage writes them as the step row's
        ``started_at`` and ``duration_ms`` (see :mod:`durable.storage.checkpoints`).
        """
        row = {
            "seq": self.seq,
            "kind": self.kind,
            "name": self.name,
            "status": self.status,
            "result": self.result,
            "error": self.error,
            "attempts": self.attempts,
            "wake_ms": self.wake_ms,
        }
        if self.started_ms is not None:
            row["started_ms"] = self.started_ms
            row["duration_ms"] = self.duration_ms
        return row

    def to_json(self) -> dict[str, Any]:
        """This record as a JSON-ready dict (the golden history file format)."""
        data: dict[str, Any] = {"seq": self.seq, "kind": self.kind, "name": self.name}
        data["status"] = self.status
        data["result"] = self.result
        if self.error:
            data["error"] = self.error
        if self.attempts:
            data["attempts"] = self.attempts
        if self.wake_ms is not None:
            data["wake_ms"] = self.wake_ms
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        """Build a record from :meth:`to_json`'s output."""
        return cls(
            seq=int(data["seq"]),
            kind=str(data["kind"]),
            name=str(data["name"]),
            status=str(data.get("status", Status.DONE)),
            result=data.get("result"),
            error=str(data.get("error", "")),
            attempts=int(data.get("attempts", 0)),
            wake_ms=data.get("wake_ms"),
        )


def changes(
    pending: Mapping[int, Record], known: Mapping[int, Record]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split ``pending`` records against the ``known`` ones into rows to insert (new seqs)
    and rows to update (known seqs whose record changed), both in seq order."""
    inserts: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    for seq, record in sorted(pending.items()):
        if seq not in known:
            inserts.append(record.row())
        elif record != known[seq]:
            updates.append(record.row())
    return inserts, updates


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPolicy:
    """How a step is retried: attempts before ``StepFailed`` and the backoff between them."""

    max_attempts: int = 5
    backoff: Backoff = field(default_factory=Backoff)
    timeout_s: float | None = None
    """An outside step's deadline (``ctx.options(timeout=...)``); None: none."""
    max_steps: int = 10_000
    """Most ctx calls a run may record (``DURABLE["MAX_STEPS_PER_RUN"]``)."""
    retry_on: tuple[type[Exception], ...] = ()
    """Only these exceptions are retried (``ctx.options(retry_on=...)``); empty: all."""
    give_up_on: tuple[type[Exception], ...] = ()
    """These exceptions fail the step at once (``ctx.options(give_up_on=...)``)."""

    def gives_up(self, exc: BaseException) -> bool:
        """Whether the step's failure ``exc`` is final: ``GiveUp``, or the policy says so
        (see :mod:`durable.dispatch.giveup`)."""
        return gives_up(exc, self.retry_on, self.give_up_on)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCall:
    """A step the backend must run now (``ctx.step`` or ``ctx.atomic``)."""

    seq: int
    kind: str
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    policy: StepPolicy
    attempt: int
    """1 for the first attempt."""

    def invoke(self, default_timeout_s: float | None = None) -> Any:
        """Call the step's function. With a deadline (its ``timeout_s``, else
        ``default_timeout_s``; outside steps only), the call runs on the calling thread's
        step thread and is abandoned past it with ``HandlerTimeout``
        (:mod:`durable.workflows.deadline`)."""
        timeout = self.policy.timeout_s
        if timeout is None:
            timeout = default_timeout_s
        if timeout is None or self.kind != Kind.STEP:
            return self.fn(*self.args, **self.kwargs)
        from durable.workflows.deadline import call_with_deadline

        return call_with_deadline(self.fn, self.args, self.kwargs, timeout)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildRequest:
    """A child run to create, validated by the context before the backend sees it."""

    run_id: str
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    model_label: str = ""
    object_pk: str = ""
    concurrency_key: str | None = None
    """Its workflow's key for this start (:mod:`durable.workflows.slots`)."""


@dataclass(frozen=True, slots=True)
class ChildHandle:
    """What ``ctx.start_child`` returns: pass it to ``ctx.wait_child``."""

    run_id: str


class Interrupt(BaseException):
    """Stops workflow code at a ctx call; a BaseException so ``except Exception`` misses it."""


class Suspend(Interrupt):
    """The run waits (sleep, signal, child, step retry); the worker lets go of it."""


class RunStopped(Interrupt):
    """The run was cancelled or finished elsewhere while replaying: write nothing more."""


class Abort(Interrupt):
    """Durable's own machinery failed (database, lease); re-raised as the original error."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class Backend(Protocol):
    """Performs the ctx calls that are not recorded yet, and says what time it is.

    Each method returns the record that now stands at ``seq`` or raises
    :class:`Suspend` after durably arranging to be woken. Errors of the user's step
    functions are part of the record (retry or failure), never raised from here.
    """

    def now_ms(self) -> int:
        """The current time (epoch ms) as this replay sees it."""
        ...

    def note(self, record: Record) -> None:
        """Record a value call (now, random, uuid4, patched) or settle a finished wait."""
        ...

    def run_step(self, call: StepCall) -> Record:
        """Run a step attempt; return its done/failed record or suspend for a retry."""
        ...

    def suspend(self, record: Record) -> Record:
        """Wait for ``record`` (a new or unfinished sleep, or a retry not due yet)."""
        ...

    def wait_signal(self, seq: int, name: str, deadline_ms: int | None) -> Record:
        """Take signal ``name`` (done), time out (done, result None) or suspend."""
        ...

    def start_child(self, seq: int, request: ChildRequest) -> Record:
        """Create the child run (idempotently) and record its id."""
        ...

    def wait_child(self, seq: int, run_id: str) -> Record:
        """Record the child's outcome once it finished, or suspend until it does."""
        ...


def too_many_steps(seq: int, limit: int) -> WorkflowError:
    """The error that fails a run making more ctx calls than ``DURABLE["MAX_STEPS_PER_RUN"]``."""
    return WorkflowError(
        f"ctx call number {seq + 1} exceeds DURABLE['MAX_STEPS_PER_RUN'] = {limit}: every "
        "replay reads a run's whole history, so a run records at most that many calls "
        "(split long work into child workflows)",
        seq=seq,
        limit=limit,
    )
