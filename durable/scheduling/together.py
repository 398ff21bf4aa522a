"""Firing a batch's cron occurrences together: one locked read, one insert, one update.

Schedules often share an instant (``every(timedelta(seconds=1))`` counts from the epoch,
``0 9 * * *`` is nine o'clock for everyone), so the worker finds many occurrences due in
one batch. Fired one by one, each pays a locked read of its schedule row, an insert of
its next occurrence's timer and an update of the row, each compiled by the ORM: about
2.5 ms of the worker's CPU an occurrence, so the hundredth of a hundred simultaneous
occurrences started a quarter of a second late.

Inside :func:`together` (the firer's fast path wraps a batch's handlers in it), the
schedule rows of every atomic cron timer of the batch are locked and read with one
statement (in name order, so two such batches never deadlock), and the next timers and
row updates are held and written with one statement each when the block ends, still
inside the batch transaction. What each occurrence decides and runs is unchanged
(:func:`durable.scheduling.occurrences.fire_atomic`); a block that raises writes nothing
(the firer then redoes the batch one occurrence at a time, outside any block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

from durable.models import CronSchedule, Timer, TimerState
from durable.storage import schedules as store
from durable.storage import timers as timer_store
from durable.storage.timers import announce, by_keys


class Together:
    """The locked rows of one batch and the writes its occurrences left for the end."""

    def __init__(self, db: str, rows: dict[str, CronSchedule], fields: Sequence[str]) -> None:
        self.db = db
        self.rows = rows
        self.fields = fields  # what an occurrence writes on its row
        self.saves: dict[str, CronSchedule] = {}
        self.timers: list[tuple[CronSchedule, Timer]] = []  # (row, its next timer)

    def locked(self, name: str) -> CronSchedule | None:
        """The schedule row locked for this batch, or None if not prefetched."""
        return self.rows.get(name)

    def insert_later(self, row: CronSchedule, timer: Timer) -> None:
        """Insert ``row``'s next timer when the block ends."""
        self.timers.append((row, timer))

    def save_later(self, row: CronSchedule) -> None:
        """Write ``row``'s run and chain fields when the block ends (last state wins)."""
        self.saves[row.name] = row

    def flush(self, now_ms: int, advance: Callable[[CronSchedule, Timer], None]) -> None:
        """Insert the held timers, then update the held rows.

        A next timer whose key is taken by a row that is not pending (clocks that
        disagree) goes to ``advance(row, timer)``, which moves the row past it the slow way.
        """
        inserted = timer_store.insert_many_if_absent(self.db, [t for _, t in self.timers])
        for row, timer in self.timers:
            if timer.key in inserted:
                continue
            existing = by_keys(self.db, [timer.key or ""]).get(timer.key or "")
            if existing is None or existing.state != TimerState.PENDING:
                advance(row, timer)  # the key was used already: move past it, one by one
                self.saves[row.name] = row
        announce(self.db, [t for _, t in self.timers if t.key in inserted], now_ms)
        store.save_many(self.db, list(self.saves.values()), self.fields)


_current: ContextVar[Together | None] = ContextVar("durable_cron_together", default=None)


def current() -> Together | None:
    """The :class:`Together` of the batch being fired, or None outside one."""
    return _current.get()


@contextmanager
def together(
    db: str,
    names: Sequence[str],
    now_ms: int,
    *,
    fields: Sequence[str],
    advance: Callable[[CronSchedule, Timer], None],
) -> Iterator[None]:
    """Lock the rows of schedules ``names`` now; write what their fires hold at the end.

    The writes (the next timers, then ``fields`` of each saved row) happen only when the
    block ends without an exception, inside the caller's transaction; ``advance`` is
    :meth:`Together.flush`'s fallback.
    """
    batch = Together(db, store.lock_many(db, names), fields)
    token = _current.set(batch)
    try:
        yield
    finally:
        _current.reset(token)
    batch.flush(now_ms, advance)
