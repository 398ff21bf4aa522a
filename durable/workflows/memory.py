"""Run a workflow in memory, replayed exactly as the worker replays it: for unit tests.

:class:`MemoryRun` keeps the history in a list instead of rows and takes its time from
a clock you move by hand (``durable.testing.ManualClock``), so a test can start a run,
see it suspend at a three-day sleep, advance the clock and resume it in microseconds,
and count how often each step function really ran. Child workflows need the database
(they are other runs); ``ctx.start_child`` raises here.

>>> run = MemoryRun(my_workflow, 42, clock=ManualClock(start_ms=0))  # doctest: +SKIP
>>> run.resume().state, run.wake_ms                                   # doctest: +SKIP
('suspended', 259200000)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

from durable.conf import get_settings
from durable.core.clock import Clock
from durable.core.errors import sanitize_error
from durable.exceptions import PayloadError, WorkflowError
from durable.scheduling.validation import check_stored
from durable.workflows.calls import check_signal
from durable.workflows.context import WorkflowContext
from durable.workflows.execute import Outcome, execute
from durable.workflows.planning import target_of
from durable.workflows.records import ChildRequest, Kind, Record, Status, StepCall, Suspend


class MemoryRun:
    """One run of a workflow held in memory; :meth:`resume` replays it from the top."""

    def __init__(self, workflow: Any, /, *args: Any, clock: Clock, **kwargs: Any) -> None:
        self.definition, self.instance = target_of(workflow)
        self.definition.check_call(self.instance, args, kwargs)
        self.args, self.kwargs = list(args), dict(kwargs)
        self.clock = clock
        self.records: dict[int, Record] = {}
        self.signals: list[tuple[str, Any]] = []
        self.calls: Counter[str] = Counter()
        """How many times each step function actually ran, by recorded name."""
        self.wake_ms: int | None = None
        """When the run wants to be resumed (a sleep's end, a retry, a deadline)."""
        self.outcome: Outcome | None = None

    @property
    def history(self) -> list[Record]:
        """The recorded calls, by seq."""
        return [self.records[seq] for seq in sorted(self.records)]

    def signal(self, name: str, payload: Any = None) -> None:
        """Send a signal (kept until a wait takes it)."""
        check_signal(name)
        check_stored(payload, "payload", get_settings().MAX_PAYLOAD_BYTES, "MAX_PAYLOAD_BYTES")
        self.signals.append((name, payload))

    def resume(self) -> Outcome:
        """Replay the code from the top against the history; return how it ended."""
        self.wake_ms = None
        ctx = WorkflowContext(
            run_id="memory",
            history=self.history,
            backend=_MemoryBackend(self),
            policy=self.definition.policy(),
            strict=self.definition.strict,
        )
        args, kwargs = self.args, self.kwargs
        self.outcome = execute(
            ctx, lambda c: self.definition.invoke(c, self.instance, args, kwargs)
        )
        return self.outcome


class _MemoryBackend:
    """The :class:`~durable.workflows.records.Backend` of a :class:`MemoryRun`."""

    def __init__(self, run: MemoryRun) -> None:
        self.run = run

    def now_ms(self) -> int:
        return self.run.clock.now_ms()

    def note(self, record: Record) -> None:
        self.run.records[record.seq] = record

    def run_step(self, call: StepCall) -> Record:
        self.run.calls[call.name] += 1
        fields = {"seq": call.seq, "kind": call.kind, "name": call.name, "attempts": call.attempt}
        try:
            result = call.fn(*call.args, **call.kwargs)
            check_stored(result, "result", get_settings().MAX_RESULT_BYTES, "MAX_RESULT_BYTES")
        except PayloadError as exc:
            record = Record(**fields, status=Status.FAILED, error=sanitize_error(exc))
        except Exception as exc:
            error = sanitize_error(exc)
            if call.attempt < call.policy.max_attempts and not call.policy.gives_up(exc):
                wake = self.now_ms() + call.policy.backoff.delay_ms(call.attempt)
                return self.suspend(
                    Record(**fields, status=Status.RETRYING, error=error, wake_ms=wake)
                )
            record = Record(**fields, status=Status.FAILED, error=error)
        else:
            record = Record(**fields, result=result)
        self.note(record)
        return record

    def suspend(self, record: Record) -> Record:
        self.note(record)
        self.run.wake_ms = record.wake_ms
        raise Suspend(f"seq {record.seq}")

    def wait_signal(self, seq: int, name: str, deadline_ms: int | None) -> Record:
        record = Record(seq=seq, kind=Kind.SIGNAL, name=name, wake_ms=deadline_ms)
        for index, (sent, payload) in enumerate(self.run.signals):
            if sent == name:
                del self.run.signals[index]
                record = replace(record, result={"payload": payload})
                self.note(record)
                return record
        if deadline_ms is not None and self.now_ms() >= deadline_ms:
            record = replace(record, result={"timeout": True})
            self.note(record)
            return record
        return self.suspend(replace(record, status=Status.WAITING))

    def start_child(self, seq: int, request: ChildRequest) -> Record:
        raise WorkflowError("child workflows need the database: test them with the worker")

    def wait_child(self, seq: int, run_id: str) -> Record:
        raise WorkflowError("child workflows need the database: test them with the worker")
