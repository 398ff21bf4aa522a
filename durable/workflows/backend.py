"""The worker's backend: each live ctx call is a checkpoint, one fenced transaction.

A checkpoint transaction starts with :func:`durable.storage.leases.fence` (a worker that
lost the run's shard commits nothing) and locks the run row with a conditional update
that checks it is still running (a run cancelled meanwhile stops at its next checkpoint,
writing nothing): before the body for waits and endings, in the same statement as the
record for steps. ``ctx.atomic`` runs its function inside that same transaction, so its
effects and its record commit together (exactly once). Checkpoints commit
asynchronously on PostgreSQL; :mod:`durable.storage.checkpoints` explains why that is
safe.

Value calls (``now``, ``random``, ``uuid4``, ``patched``) and the settling of a finished
sleep are not worth a transaction of their own: they are written with the next
checkpoint. Nothing outside durable could have seen them in between, except a step's
outside effects, which are at-least-once anyway; everything that commits (an atomic
step, a suspension, the end of the run) commits with them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Any

from django.db import transaction

from durable.conf import get_settings
from durable.core.errors import sanitize_error
from durable.dispatch.context import current_fire
from durable.exceptions import PayloadError
from durable.models import WorkflowState
from durable.scheduling.validation import check_stored
from durable.storage import checkpoints as cp
from durable.storage import run_slots
from durable.storage import workflows as store
from durable.workflows.checkpointing import CheckpointWriter
from durable.workflows.deadline import keeps_step_thread
from durable.workflows.records import (
    ChildRequest,
    Kind,
    Record,
    Status,
    StepCall,
    Suspend,
)
from durable.workflows.slots import run_shard

log = logging.getLogger("durable.workflows")
FINISHED = ("completed", "failed", "canceled")


def event(level: int, name: str, **fields: Any) -> None:
    """Log ``name key=value ...`` (the worker's structured-event format)."""
    if log.isEnabledFor(level):
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        log.log(level, "%s %s", name, text, extra={"durable": {"event": name, **fields}})


class _StepError(Exception):
    """Carries a step function's exception out of the checkpoint it rolled back."""

    def __init__(self, error: Exception, final: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.final = final


class DatabaseBackend(CheckpointWriter):
    """Performs one run's live ctx calls against ``db`` (see the module docstring).

    Its checkpoints (the fenced transactions and the pending records they write) are
    :class:`~durable.workflows.checkpointing.CheckpointWriter`'s.
    """

    # -- steps -------------------------------------------------------------------------

    def run_step(self, call: StepCall) -> Record:
        """Run one attempt of a step; record done/failed, or schedule a retry and suspend."""
        started = time.monotonic()
        try:
            return self._run_step(call)
        finally:
            fire = current_fire()
            if fire is not None and fire.metrics is not None:
                fire.metrics.step_duration.labels(call.kind).observe(time.monotonic() - started)

    def _run_step(self, call: StepCall) -> Record:
        if call.kind == Kind.ATOMIC:
            return self._run_atomic(call)
        # The attempt's times ride in its record, written by the checkpoint that exists
        # anyway (the admin's timeline draws them); the injected clock, as everywhere.
        started = self.now_ms()
        try:
            result = call.invoke(_step_deadline_s())
        except Exception as exc:
            return self._failed(call, exc, final=False, started=started)
        try:
            check_result(result)
        except PayloadError as exc:
            return self._failed(call, exc, final=True, started=started)
        record = self._timed(_done(call, result), started)
        self._pending[record.seq] = record
        if not self._record_fast():
            with self.checkpoint(hold_first=False):
                pass  # writes the pending records, this step's among them
        return record

    def _run_atomic(self, call: StepCall) -> Record:
        record = _done(call, None)
        started = self.now_ms()
        try:
            with self.checkpoint(hold_first=False):
                try:
                    with transaction.atomic(using=self.db):
                        result = call.fn(*call.args, **call.kwargs)
                except Exception as exc:
                    raise _StepError(exc, final=False) from exc
                try:
                    check_result(result)
                except PayloadError as exc:
                    raise _StepError(exc, final=True) from exc
                record = self._timed(replace(record, result=result), started)
                self.write(record)
        except _StepError as failure:  # the checkpoint rolled back with the step's writes
            return self._failed(call, failure.error, final=failure.final, started=started)
        return record

    def _timed(self, record: Record, started: int) -> Record:
        """``record`` with its attempt's start and duration (ended now)."""
        return replace(record, started_ms=started, duration_ms=max(0, self.now_ms() - started))

    def _failed(self, call: StepCall, exc: Exception, *, final: bool, started: int) -> Record:
        error = sanitize_error(exc)
        ended = self.now_ms()
        fields = {"seq": call.seq, "kind": call.kind, "name": call.name, "error": error,
                  "started_ms": started, "duration_ms": max(0, ended - started)}  # fmt: skip
        final = final or call.policy.gives_up(exc)  # GiveUp, give_up_on, retry_on
        if final or call.attempt >= call.policy.max_attempts:
            record = Record(**fields, status=Status.FAILED, attempts=call.attempt)
            with self.checkpoint():
                self.write(record)
            event(logging.WARNING, "workflow.step_failed", run=self.run_id, seq=call.seq,
                  step=call.name, attempts=call.attempt, error=error)  # fmt: skip
            return record
        wake = ended + call.policy.backoff.delay_ms(call.attempt)
        record = Record(**fields, status=Status.RETRYING, attempts=call.attempt, wake_ms=wake)
        event(logging.INFO, "workflow.step_retry", run=self.run_id, seq=call.seq,
              step=call.name, attempt=call.attempt, retry_at_ms=wake, error=error)  # fmt: skip
        return self.suspend(record)

    # -- waiting -------------------------------------------------------------------------

    def suspend(self, record: Record) -> Record:
        """Wait for a sleep to end or a retry to be due: record, arm the timer, let go."""
        assert record.wake_ms is not None
        with self.checkpoint():
            self.write(record)
            self._wake(suspend_key(self.run_id, record), record.wake_ms)
            cp.set_state(self.db, self.run_id, WorkflowState.SLEEPING)
            self._last = True  # the replay's last checkpoint: the wake-up fires with it
        raise Suspend(f"run {self.run_id} sleeps until {record.wake_ms} (seq {record.seq})")

    def wait_signal(self, seq: int, name: str, deadline_ms: int | None) -> Record:
        """Take signal ``name``, time out, or record the wait and suspend."""
        key = store.wake_key(self.run_id, seq)
        now = self.now_ms()
        record = Record(seq=seq, kind=Kind.SIGNAL, name=name, wake_ms=deadline_ms)
        with self.checkpoint():
            found, payload = cp.take_signal(self.db, self.run_id, name, seq, now)
            if found:
                record = replace(record, result={"payload": payload})
                if deadline_ms is not None:
                    store.cancel_wake(self.db, key, now)
            elif deadline_ms is not None and now >= deadline_ms:
                record = replace(record, result={"timeout": True})
            else:
                record = replace(record, status=Status.WAITING)
                if deadline_ms is not None:
                    self._wake(key, deadline_ms)
                cp.set_state(
                    self.db, self.run_id, WorkflowState.WAITING, wait_signal=name, wait_seq=seq
                )
                self._last = True  # the replay's last checkpoint: the wake-up fires with it
            self.write(record)
        if record.status == Status.WAITING:
            raise Suspend(f"run {self.run_id} waits for signal {name!r} (seq {seq})")
        return record

    def start_child(self, seq: int, request: ChildRequest) -> Record:
        """Create the child run and its start timer (idempotently); record its id."""
        result: dict[str, Any] = {"run_id": request.run_id}
        with self.checkpoint():
            fields = asdict(request)
            fields["id"] = fields.pop("run_id")
            shard = run_shard(request.run_id, request.concurrency_key, _shards())
            child = store.new_run(fields, shard, self.run_id)
            child, created = store.insert_run(self.db, child)
            if created:
                key = store.wake_key(child.pk, "start")
                now = self.now_ms()
                limit = child.concurrency_key
                store.ensure_wake(self.db, child.pk, child.shard, key, now, now, limit)
            elif child.parent_id != self.run_id:
                result["error"] = f"run id {child.pk!r} is taken by a run that is not a child"
            record = Record(seq=seq, kind=Kind.CHILD, name=request.name, result=result)
            self.write(record)
        return record

    def wait_child(self, seq: int, run_id: str) -> Record:
        """Record the child's outcome if it finished; otherwise record the wait and suspend."""
        record = Record(seq=seq, kind=Kind.WAIT_CHILD, name=run_id)
        with self.checkpoint():
            child = cp.child_outcome(self.db, run_id)
            if child is None:
                record = replace(record, result={"state": "missing", "error": "no such run"})
            elif child["state"] in FINISHED:
                record = replace(record, result=child)
            else:
                record = replace(record, status=Status.WAITING)
                cp.set_state(self.db, self.run_id, WorkflowState.WAITING, wait_seq=seq)
                self._last = True  # the replay's last checkpoint: the wake-up fires with it
            self.write(record)
        if record.status == Status.WAITING:
            raise Suspend(f"run {self.run_id} waits for child {run_id} (seq {seq})")
        return record

    # -- the end -----------------------------------------------------------------------

    def finish(self, state: str, result: Any = None, error: str = "") -> None:
        """Record the run's end and wake its parent, if it has one."""
        if self._finish_fast(state, result, error):
            return
        with self.checkpoint():
            now = self.now_ms()
            cp.finish(self.db, self.run_id, state, result, error, now)
            if self.keyed:  # its slot goes to the next in its key's line
                run_slots.release_runs(self.db, [self.run_id], now, _bucket_shift())
            parent = self.parent_id
            if parent is not None:
                key = store.wake_key(parent, "child", self.run_id)
                shard = store.shard_of(self.db, parent)
                store.ensure_wake(self.db, parent, shard, key, now, now)
            self._last = True  # the replay's last checkpoint: the wake-up fires with it

    def _finish_fast(self, state: str, result: Any, error: str) -> bool:
        """End the run in one statement (PostgreSQL; no parent to wake, no record to
        change): the run's end, its pending records and its wake-up's fire commit together.
        False when the general checkpoint must do it."""
        if self.keyed:  # the general checkpoint frees its slot in the same transaction
            return False
        rows = self._new_rows() if self.parent_id is None else None
        if rows is None:
            return False
        fire = current_fire()
        claim = None
        if fire is not None and fire.token is not None and not fire.completed:
            claim = cp.Claim(timer_id=fire.timer_id, attempts=fire.attempt, token=fire.token)
        end = (state, result, error)
        ended, fired = cp.finish_run(
            self.db, self.run_id, self.lease, end, rows, claim, self.now_ms()
        )
        self._written(ended)
        if fired:
            assert fire is not None
            transaction.on_commit(lambda: fire.completed.append(True), using=self.db)
        return True


def suspend_key(run_id: str, record: Record) -> str:
    """The key of the timer that ends a sleep or a step's wait for its retry."""
    if record.status == Status.RETRYING:
        return store.wake_key(run_id, record.seq, f"a{record.attempts}")
    return store.wake_key(run_id, record.seq)


def check_result(result: Any) -> None:
    """Raise :class:`PayloadError` if a step's result is not JSON or is larger than
    ``DURABLE["MAX_RESULT_BYTES"]``: it fails the step for good (no retry shrinks it)."""
    check_stored(result, "result", get_settings().MAX_RESULT_BYTES, "MAX_RESULT_BYTES")


def _done(call: StepCall, result: Any) -> Record:
    return Record(
        seq=call.seq, kind=call.kind, name=call.name, result=result, attempts=call.attempt
    )


def _shards() -> int:
    return get_settings().SHARDS


def _bucket_shift() -> int:
    return get_settings().BUCKET_SHIFT


def _step_deadline_s() -> float | None:
    """An outside step's default deadline when the worker fires the replay:
    ``HANDLER_TIMEOUT_S``, never past ``CLAIM_TIMEOUT_S`` (after which the replay's wake-up
    would be claimed again). None off the worker's handler threads (a replay called
    directly)."""
    if not keeps_step_thread():
        return None
    conf = get_settings()
    return min(conf.HANDLER_TIMEOUT_S, conf.CLAIM_TIMEOUT_S)
