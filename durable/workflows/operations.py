"""Operating on runs from application code: signal, cancel, retry, read, list.

Each call writes in the caller's transaction on ``DURABLE["DATABASE"]`` (it never
commits on its own) and locks the run row first, which orders it against the replay's
checkpoints: a signal sent while the run is being replayed is either seen by its wait,
or wakes the run once the wait is recorded; a run cancelled mid-replay stops at its
next checkpoint.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any, overload

from django.db import transaction

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.exceptions import UnknownWorkflow, WorkflowError
from durable.models import Timer, WorkflowRun, WorkflowRunQuerySet, WorkflowSignal, WorkflowState
from durable.scheduling.validation import check_stored, check_text, fire_at_ms
from durable.storage import workflows as store
from durable.workflows.calls import check_signal


def _run_id(run: WorkflowRun | str) -> str:
    if isinstance(run, WorkflowRun):
        return str(run.pk)
    if not isinstance(run, str):
        raise TypeError(f"run_id: expected a run id or a WorkflowRun, got {type(run).__name__}")
    return str(check_text(run, "run_id"))  # NUL would fail in the database's query


def _locked(db: str, run_id: str) -> WorkflowRun:
    run = store.lock_run(db, run_id)
    if run is None:
        raise UnknownWorkflow(f"no workflow run with id {run_id!r}", run_id=run_id)
    return run


@overload
def send_signal(run_id: WorkflowRun | str, name: str, payload: Any = None) -> WorkflowSignal: ...


@overload
def send_signal(
    run_id: WorkflowRun | str, name: str, payload: Any = None, *, at: datetime
) -> Timer: ...


@overload
def send_signal(
    run_id: WorkflowRun | str, name: str, payload: Any = None, *, delay: timedelta
) -> Timer: ...


def send_signal(
    run_id: WorkflowRun | str,
    name: str,
    payload: Any = None,
    *,
    at: datetime | None = None,
    delay: timedelta | None = None,
) -> WorkflowSignal | Timer:
    """Send signal ``name`` with a JSON ``payload`` to a run; kept until a wait takes it.

    Written in the caller's transaction (atomic with it). Raises
    :class:`~durable.exceptions.UnknownWorkflow` for an unknown run and
    :class:`~durable.exceptions.WorkflowError` for a finished one.

    With ``at`` (an aware datetime; a past one means now) or ``delay`` (a ``timedelta``),
    the signal is scheduled instead: a durable timer (kind ``signal``), written in the
    caller's transaction and returned, that delivers it then, as this call would. Cancel
    it with ``durable.cancel(timer)``. Its payload must fit ``MAX_PAYLOAD_BYTES``. If
    the run has finished when it fires, the timer is dead-lettered with that error (see
    :mod:`durable.workflows.scheduled`).
    """
    run_id = _run_id(run_id)
    check_signal(name)
    conf = get_settings()
    check_stored(payload, "payload", conf.MAX_PAYLOAD_BYTES, "MAX_PAYLOAD_BYTES")
    now_ms = current_clock().now_ms()
    if at is not None or delay is not None:
        from durable.workflows.scheduled import schedule_signal

        return schedule_signal(run_id, name, payload, fire_at_ms(at, delay, now_ms), now_ms)
    db = conf.DATABASE
    with transaction.atomic(using=db, savepoint=False):
        run = _locked(db, run_id)
        if run.finished:
            raise WorkflowError(
                f"run {run_id} is {run.state}; it takes no more signals", run_id=run_id
            )
        signal = store.add_signal(db, run_id, name, payload, now_ms)
        if run.state == WorkflowState.WAITING and run.wait_signal == name:
            key = store.wake_key(run_id, run.wait_seq, "signal")
            store.ensure_wake(db, run_id, run.shard, key, now_ms, now_ms)
    return signal


def cancel_workflow(run_id: WorkflowRun | str) -> bool:
    """Cancel a run, its unfinished child runs (recursively) and their pending timers.

    True if this call cancelled it; False if it had already finished. A run being
    replayed stops at its next checkpoint (a step already running finishes, but its
    result is not recorded). The parent of a cancelled child is woken, and its
    ``ctx.wait_child`` raises ``ChildWorkflowFailed``. A cancelled run of a limited
    workflow frees its key's slot in this transaction (the next in line is made due); one
    still waiting in its key's line just leaves it.
    """
    run_id = _run_id(run_id)
    conf = get_settings()
    db = conf.DATABASE
    now_ms = current_clock().now_ms()
    with transaction.atomic(using=db, savepoint=False):
        run = _locked(db, run_id)
        if run.finished:
            return False
        store.cancel_tree(db, run, now_ms)
        if run.parent_id is not None:
            key = store.wake_key(run.parent_id, "child", run_id)
            parent_shard = store.shard_of(db, run.parent_id)
            store.ensure_wake(db, run.parent_id, parent_shard, key, now_ms, now_ms)
    return True


def retry(run_id: WorkflowRun | str) -> WorkflowRun:
    """Run a failed run again from its last checkpoint; return it (now pending).

    Recorded steps are not run again. A step that had used up its attempts (the last
    record) is dropped, so it gets a fresh set of attempts. A run of a limited workflow
    takes a slot of its key again: its retry waits in the key's line, as a new arrival,
    while the key is full. Raises :class:`~durable.exceptions.WorkflowError` unless the
    run failed.
    """
    run_id = _run_id(run_id)
    db = get_settings().DATABASE
    now_ms = current_clock().now_ms()
    with transaction.atomic(using=db, savepoint=False):
        run = _locked(db, run_id)
        if run.state != WorkflowState.FAILED:
            raise WorkflowError(
                f"only failed runs can be retried; run {run_id} is {run.state}", run_id=run_id
            )
        store.reopen(db, run, now_ms)
        key = store.wake_key(run_id, "retry", run.retries + 1)
        # A keyed run takes a slot again: its retry waits in its key's line if it is full.
        limit = run.concurrency_key
        store.ensure_wake(db, run_id, run.shard, key, now_ms, now_ms, limit)
        run.refresh_from_db(using=db)
    return run


#: Waiting for a run polls its row: every millisecond at first, then at a twentieth of the
#: time waited so far (a run that takes minutes is read a few times a second), at most
#: every ``MAX_POLL_S``.
MIN_POLL_S = 0.001
MAX_POLL_S = 0.5
_FINISHED = (WorkflowState.COMPLETED, WorkflowState.FAILED, WorkflowState.CANCELED)


def get_result(run_id: WorkflowRun | str, *, timeout: float | None = None) -> Any:
    """The result of a completed run.

    Raises :class:`~durable.exceptions.WorkflowError` (with ``state`` and ``error``
    attributes) if the run failed, was cancelled or has not finished, and
    :class:`~durable.exceptions.UnknownWorkflow` if there is no such run.

    ``timeout`` (seconds) waits that long at most for an unfinished run to finish, by
    reading its row: every millisecond at first, less often the longer the wait (see
    ``MAX_POLL_S``). Do not wait inside a transaction: the run's end, committed by the
    worker, may be invisible to it (repeatable read) and the wait holds the transaction.
    """
    run_id = _run_id(run_id)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or timeout < 0):  # fmt: skip
        raise ValueError(f"timeout: expected a number of seconds >= 0, got {timeout!r}")
    started = time.monotonic()
    while True:
        row = runs().filter(pk=run_id).values("state", "result", "error").first()
        if row is None:
            raise UnknownWorkflow(f"no workflow run with id {run_id!r}", run_id=run_id)
        waited = time.monotonic() - started
        if row["state"] in _FINISHED or timeout is None or waited >= timeout:
            break
        time.sleep(min(max(MIN_POLL_S, waited / 20), MAX_POLL_S, timeout - waited))
    if row["state"] != WorkflowState.COMPLETED:
        detail = f": {row['error']}" if row["error"] else ""
        raise WorkflowError(
            f"run {run_id} is {row['state']}{detail}",
            run_id=run_id,
            state=row["state"],
            error=row["error"],
        )
    return row["result"]


def runs() -> WorkflowRunQuerySet:
    """Every run on ``DURABLE["DATABASE"]``, to filter: ``runs().active().named(wf)``."""
    queryset: WorkflowRunQuerySet = store.runs(get_settings().DATABASE)
    return queryset
