"""Wake-ups replayed inside the firing batch: many runs, one transaction.

Most wake-ups of a sleeping run perform nothing live: the sleep has ended, and the code
returns or sleeps again. Such a replay needs no executor thread and no transactions of
its own. The ``workflow`` kind's batch scope therefore reads the runs of the batch's
workflow timers in one statement (locked; a run locked elsewhere is skipped), replays
each against an :class:`InlineBackend`, which only records, and writes what the replays
ended with in one statement per table, in the batch transaction, before the firer marks
their timers fired: the run's end and its timer commit together, under the batch's fence.

A replay that reaches a live call (a step to run, a signal to take, a child to start or
to wait for) stops there with :class:`NeedsWorker`. It has performed nothing, so it is
simply dropped, and its timer takes the usual way: claimed, then replayed from the top
on the executor, with a checkpoint per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.db import transaction

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.errors import sanitize_error
from durable.dispatch.kinds import FiringBatch, RedoCarefully
from durable.models import WorkflowState
from durable.storage import run_slots, wakeups
from durable.storage import workflows as store
from durable.storage.checkpoints import RunSnapshot
from durable.workflows.backend import event, suspend_key
from durable.workflows.records import Record, Suspend, changes

if TYPE_CHECKING:
    from durable.workflows.runguard import Handovers, RunGuard


_ENDS = (WorkflowState.COMPLETED, WorkflowState.FAILED, WorkflowState.CANCELED)


class NeedsWorker(Exception):
    """The replay reached a call it cannot make inside the batch: replay it on the executor."""


class InlineBackend:
    """The :class:`~durable.workflows.records.Backend` of a replay inside the firing batch.

    Its time is the batch's (the fire that judged the wake-up due). Value calls and
    settled sleeps are kept; a suspension or the run's end is kept as the run's
    :class:`~durable.storage.wakeups.RunEnd`; anything live raises :class:`NeedsWorker`.
    """

    def __init__(self, snapshot: RunSnapshot, history: list[Record], now_ms: int) -> None:
        self.run_id = snapshot.id
        self.shard = snapshot.shard
        self.parent_id = snapshot.parent_id
        self.keyed = snapshot.concurrency_key is not None
        self._now = now_ms
        self._known = {record.seq: record for record in history}
        self._pending: dict[int, Record] = {}
        self.end: wakeups.RunEnd | None = None
        self.wake: tuple[str, int] | None = None
        """(key, fire_at_ms) of the timer a suspension needs."""

    def now_ms(self) -> int:
        return self._now

    def note(self, record: Record) -> None:
        self._pending[record.seq] = record

    def suspend(self, record: Record) -> Record:
        assert record.wake_ms is not None
        self.note(record)
        self.wake = (suspend_key(self.run_id, record), record.wake_ms)
        self._end(WorkflowState.SLEEPING)
        raise Suspend(f"run {self.run_id} sleeps until {record.wake_ms} (seq {record.seq})")

    def finish(self, state: str, result: Any = None, error: str = "") -> None:
        self._end(state, result, error)

    def _end(self, state: str, result: Any = None, error: str = "") -> None:
        inserts, updates = changes(self._pending, self._known)
        self.end = wakeups.RunEnd(
            run_id=self.run_id,
            state=state,
            inserts=inserts,
            updates=updates,
            result=result,
            error=error,
        )

    def run_step(self, call: Any) -> Record:
        raise NeedsWorker(f"step {call.name!r}")

    def wait_signal(self, seq: int, name: str, deadline_ms: int | None) -> Record:
        raise NeedsWorker(f"signal {name!r}")

    def start_child(self, seq: int, request: Any) -> Record:
        raise NeedsWorker("start_child")

    def wait_child(self, seq: int, run_id: str) -> Record:
        raise NeedsWorker("wait_child")


class InlineBatch:
    """The inline replays of one firing batch: those that ended, and which timers fired."""

    def __init__(self) -> None:
        self.backends: dict[str, InlineBackend] = {}
        self.handover: dict[str, RunSnapshot] = {}
        """Runs whose replay needs the executor, as read."""
        self.sent: set[str] = set()
        """Runs a timer of which the firer sent to the executor (those of ``handover``
        among them are marked running by the batch and handed over); known at
        :meth:`write`, from ``FiringBatch.sent``."""
        self.fired: set[str] = set()
        """Runs whose timer the firer has run (a timer left for the next batch has not)."""

    def fire(self, run_id: str) -> str:
        """The handler of an inline run's timer: its replay is done; say where it stands."""
        self.fired.add(run_id)
        end = self.backends[run_id].end
        assert end is not None
        return end.state

    def handed_over(self) -> dict[str, RunSnapshot]:
        """The histories to hand over: runs that need the executor and whose timer the
        firer sent there in this batch (not one left for the next batch)."""
        return {run_id: self.handover[run_id] for run_id in sorted(self.sent & set(self.handover))}

    def write(self, db: str, timers: Sequence[Any], firing: FiringBatch) -> None:
        """Write the ends of the runs whose timers fired, their wake-ups and their parents';
        mark the handed-over runs running and claim their timers (``firing.claimed``)."""
        backends = [self.backends[run_id] for run_id in sorted(self.fired)]
        ends = [b.end for b in backends if b.end is not None]
        now = current_clock().now_ms()
        wakeups.write_ends(db, ends, now)
        # The keyed runs that ended hand their slots to the next in line.
        ended = [b.run_id for b in backends if b.keyed and b.end and b.end.state in _ENDS]
        run_slots.release_runs(db, ended, now, get_settings().BUCKET_SHIFT)
        sent = [timer for timer in timers if timer.id in firing.sent]
        self.sent = {timer.target for timer in sent}
        handed = list(self.handed_over())
        firing.claimed |= wakeups.mark_running(
            db,
            handed,
            now,
            _lone_timers(sent, handed),
            firing.claim_until_ms,
            firing.tokens,
            lazy=firing.only_claims,
        )
        for backend in backends:
            assert backend.end is not None
            if backend.wake is not None:
                key, fire_at = backend.wake
                store.ensure_wake(db, backend.run_id, backend.shard, key, fire_at, now)
            elif backend.parent_id is not None:
                parent = backend.parent_id
                key = store.wake_key(parent, "child", backend.run_id)
                store.ensure_wake(db, parent, store.shard_of(db, parent), key, now, now)


def _lone_timers(timers: Sequence[Any], run_ids: Sequence[str]) -> list[int]:
    """The timers of ``timers`` that are their run's only one in the batch, for ``run_ids``.

    A handed-over run's timer went to the executor; it is claimed with its run marked
    running. A run with two timers sent in the batch is left to the firer's claim.
    """
    wanted = set(run_ids)
    per_run: dict[str, list[int]] = {}
    for timer in timers:
        if timer.target in wanted:
            per_run.setdefault(timer.target, []).append(timer.id)
    return sorted(ids[0] for ids in per_run.values() if len(ids) == 1)


#: ``replay(backend, snapshot, history)``: one replay, as ``resume.replay`` runs it.
Replay = Callable[[InlineBackend, RunSnapshot, list[Record]], str]


@contextmanager
def replaying(
    db: str,
    timers: Sequence[Any],
    firing: FiringBatch,
    guard: RunGuard,
    replay: Replay,
    handovers: Handovers,
) -> Iterator[InlineBatch]:
    """Replay the runs of ``timers`` inline; on exit, write the ends of those fired and
    claim the timers of the runs handed over.

    A run that another thread of this worker is replaying is left to the usual way (its
    guard is busy, and the busy replay is asked to go round again). The histories of the
    runs that need the executor are offered to ``handovers``, confirmed on commit.
    """
    batch = InlineBatch()
    entered: list[str] = []
    try:
        try:
            snapshots = wakeups.lock_runs(db, sorted({timer.target for timer in timers}))
        except Exception as exc:
            raise RedoCarefully("reading the runs failed") from exc
        for run_id, snapshot in snapshots.items():
            if not guard.enter(run_id):
                continue
            entered.append(run_id)
            history = [Record(**step) for step in snapshot.steps]
            backend = InlineBackend(snapshot, history, firing.now_ms)
            try:
                replay(backend, snapshot, history)
            except NeedsWorker:
                batch.handover[run_id] = snapshot
                continue
            except Exception as exc:  # durable's own failure: the executor's replay reports it
                event(logging.DEBUG, "workflow.inline_skipped", run=run_id,
                      error=sanitize_error(exc))  # fmt: skip
                continue
            if backend.end is not None:
                batch.backends[run_id] = backend
        yield batch
        try:
            batch.write(db, timers, firing)
        except Exception as exc:  # the batch is redone without inline replays
            event(logging.WARNING, "workflow.inline_write_failed", error=sanitize_error(exc))
            raise RedoCarefully("writing the inline replays failed") from exc
        for run_id in batch.fired:
            handovers.discard(run_id)
        handed = batch.handed_over()
        if handed:
            token = handovers.offer(handed)
            transaction.on_commit(lambda: handovers.confirm(list(handed), token), using=db)
    finally:
        # Nothing of these runs is replayed in this process until the batch commits: the
        # executor's replays begin by updating the run row, which waits for our lock.
        for run_id in entered:
            guard.leave(run_id)
