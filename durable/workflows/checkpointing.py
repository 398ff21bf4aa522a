"""Checkpoints of a live replay: one fenced transaction each, with the pending records.

:class:`CheckpointWriter` is the part of :class:`~durable.workflows.backend.DatabaseBackend`
that writes: it keeps the records not written yet (value calls, a settled sleep), opens
each checkpoint (fence the shard, lock the run, write the pending records), takes the
one-statement path on PostgreSQL when every pending record is new, and marks the wake-up
timer fired in a replay's last checkpoint. The ctx calls themselves (steps, waits,
children, the end) are the backend's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import transaction

from durable.core.clock import Clock
from durable.dispatch.context import current_fire
from durable.storage import checkpoints as cp
from durable.storage import firing
from durable.storage import workflows as store
from durable.storage.leases import fence
from durable.workflows.records import Record, RunStopped, changes


class CheckpointWriter:
    """One run's checkpoint transactions and pending records (see the module docstring)."""

    def __init__(
        self,
        *,
        db: str,
        run_id: str,
        shard: int,
        lease: tuple[int, int] | None,
        clock: Clock,
        floor_ms: int,
        recorded: list[Record],
        parent_id: str | None = None,
        keyed: bool = False,
    ) -> None:
        self.db = db
        self.run_id = run_id
        self.shard = shard
        self.lease = lease
        self.clock = clock
        self.floor_ms = floor_ms
        self.parent_id = parent_id
        self.keyed = keyed
        """Its workflow has a concurrency key: its end frees a slot (:meth:`finish`)."""
        self._known = {record.seq: record for record in recorded}
        self._pending: dict[int, Record] = {}
        self._last = False  # set inside a checkpoint that ends the replay (see checkpoint())

    # -- time and deferred records -------------------------------------------------------

    def now_ms(self) -> int:
        """The clock, but never before the fire that woke us (the worker's clock is
        the one that judged the wake-up due, so a sleep it woke is never still early)."""
        return max(self.clock.now_ms(), self.floor_ms)

    def note(self, record: Record) -> None:
        """Keep ``record`` for the next checkpoint."""
        self._pending[record.seq] = record

    @contextmanager
    def checkpoint(self, *, hold_first: bool = True) -> Iterator[None]:
        """One fenced transaction that also writes the pending records.

        ``hold_first`` locks the run row (writing the pending records in the same
        statement) before the body runs, which waits and endings need: a signal sent
        meanwhile must see the run waiting, or the wait must see the signal. Steps lock
        it at the end, in the same statement as their record. A body that suspends or
        ends the run sets ``_last``: the wake-up timer is then marked fired at the end.
        """
        before = dict(self._pending)
        staged: dict[int, Record] = {}
        try:
            with transaction.atomic(using=self.db):
                if self.lease is not None:
                    fence(self.db, *self.lease)
                now = self.now_ms()
                if hold_first:
                    self._flush(staged, now, held=False)
                yield
                if self._pending or not hold_first:
                    self._flush(staged, now, held=hold_first)
                if self._last:
                    # Last of all: its synchronous commit setting must not be overridden
                    # by a flush's asynchronous one.
                    self._complete_wakeup()
        except BaseException:
            self._pending = before  # what this checkpoint wrote rolled back with it
            raise
        finally:
            self._last = False
        self._known.update(staged)

    def write(self, record: Record) -> None:
        """Write ``record`` in the current checkpoint, with the pending ones."""
        self._pending[record.seq] = record

    def _flush(self, staged: dict[int, Record], now: int, *, held: bool) -> None:
        """Write the pending records (locking the run first unless ``held``)."""
        inserts, updates = changes(self._pending, {**self._known, **staged})
        if not cp.commit_steps(self.db, self.run_id, inserts, updates, now, held=held):
            raise RunStopped(f"run {self.run_id} is no longer running")
        staged.update(self._pending)
        self._pending.clear()

    def _record_fast(self) -> bool:
        """Write the pending records in one statement, if they are all new (PostgreSQL).

        True when done; False when the general checkpoint must do it (another database,
        or a pending record that updates an earlier one, such as a settled sleep).
        """
        rows = self._new_rows()
        if rows is None:
            return False
        self._written(cp.record_steps(self.db, self.run_id, self.lease, rows, self.now_ms()))
        return True

    def _new_rows(self) -> list[dict[str, Any]] | None:
        """The pending records as rows, if the one-statement paths can write them
        (PostgreSQL, and no record that changes an earlier one); else None."""
        if not cp.is_postgres(self.db):
            return None
        inserts, updates = changes(self._pending, self._known)
        return None if updates else inserts

    def _written(self, running: bool) -> None:
        """After a one-statement write: the pending records are known now, or, if the run
        was no longer running, nothing was written and the replay stops."""
        pending, self._pending = self._pending, {}
        if not running:
            raise RunStopped(f"run {self.run_id} is no longer running")
        self._known.update(pending)

    def _complete_wakeup(self) -> None:
        """Mark the wake-up timer that started this replay fired, in this (last) checkpoint
        (the run suspends or ends with it).

        The firer would otherwise do it in a transaction of its own once the replay
        returns. A replay that goes round again reaches here again: a no-op then.
        """
        fire = current_fire()
        if fire is None or fire.token is None or fire.shard is None or fire.completed:
            return
        now = self.now_ms()
        if firing.complete_claim(self.db, fire.timer_id, fire.attempt, fire.shard, fire.token, now):
            transaction.on_commit(lambda: fire.completed.append(True), using=self.db)

    def _wake(self, key: str, fire_at_ms: int) -> None:
        store.ensure_wake(self.db, self.run_id, self.shard, key, fire_at_ms, self.now_ms())
