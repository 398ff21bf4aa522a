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
from typing import Any

from django.db import connections
from django.db.models.constants import OnConflict
from django.utils import timezone

from durable.core.timeutil import ms_to_datetime
from durable.models import CronSchedule, Timer, TimerState
from durable.storage.timers import announce, by_keys


class Together:
    """The locked rows of one batch and the writes its occurrences left for the end."""

    def __init__(self, db: str, rows: dict[str, CronSchedule]) -> None:
        self.db = db
        self.rows = rows
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
        inserted = _insert_ignoring_taken_keys(self.db, [t for _, t in self.timers])
        for row, timer in self.timers:
            if timer.key in inserted:
                continue
            existing = by_keys(self.db, [timer.key or ""]).get(timer.key or "")
            if existing is None or existing.state != TimerState.PENDING:
                advance(row, timer)  # the key was used already: move past it, one by one
                self.saves[row.name] = row
        announce(self.db, [t for _, t in self.timers if t.key in inserted], now_ms)
        _update_rows(self.db, list(self.saves.values()))


_current: ContextVar[Together | None] = ContextVar("durable_cron_together", default=None)


def current() -> Together | None:
    """The :class:`Together` of the batch being fired, or None outside one."""
    return _current.get()


@contextmanager
def together(
    db: str,
    names: Sequence[str],
    now_ms: int,
    advance: Callable[[CronSchedule, Timer], None],
) -> Iterator[None]:
    """Lock the rows of schedules ``names`` now; write what their fires hold at the end.

    The writes happen only when the block ends without an exception, inside the
    caller's transaction; ``advance`` is :meth:`Together.flush`'s fallback.
    """
    rows = CronSchedule.objects.using(db).select_for_update().filter(name__in=sorted(set(names)))
    batch = Together(db, {row.name: row for row in rows.order_by("name")})
    token = _current.set(batch)
    try:
        yield
    finally:
        _current.reset(token)
    batch.flush(now_ms, advance)


def _insert_ignoring_taken_keys(db: str, timers: list[Timer]) -> set[str]:
    """Insert ``timers`` in one statement; return the keys that were new."""
    if not timers:
        return set()
    fields = [f for f in Timer._meta.concrete_fields if not f.primary_key]
    key_field = Timer._meta.get_field("key")
    rows = Timer.objects.using(db)._insert(
        timers,
        fields=fields,
        returning_fields=[Timer._meta.pk, key_field],
        on_conflict=OnConflict.IGNORE,
    )
    by_key = {timer.key: timer for timer in timers}
    new: set[str] = set()
    for returned in rows or []:
        if returned is None:  # one timer, and its key was taken
            continue
        pk, key = returned
        timer = by_key[key]
        timer.pk = pk
        timer._state.adding = False
        timer._state.db = db
        new.add(key)
    return new


#: The columns an occurrence writes (see occurrences.RUN_FIELDS and CHAIN_FIELDS).
_WRITTEN = (
    "last_scheduled_ms",
    "last_started_ms",
    "last_run_at",
    "last_duration_ms",
    "last_status",
    "last_error",
    "fired_count",
    "failed_count",
    "busy_since_ms",
    "next_ms",
    "skipped_count",
    "running",
    "running_until_ms",
    "next_at",
    "updated_at",
)


def _update_rows(db: str, rows: list[CronSchedule]) -> None:
    """``UPDATE ... FROM (VALUES ...)`` of the written columns, one statement (PostgreSQL)."""
    if not rows:
        return
    now = timezone.now()
    for row in rows:
        row.next_at = None if row.next_ms is None else ms_to_datetime(row.next_ms)
        row.updated_at = now
    connection = connections[db]
    if connection.vendor != "postgresql" or len(rows) == 1:
        for row in rows:
            row.save(using=db, update_fields=list(_WRITTEN))
        return
    fields = [CronSchedule._meta.get_field(name) for name in _WRITTEN]
    pk = CronSchedule._meta.pk
    casts = [f"%s::{pk.db_type(connection)}"]
    casts += [f"%s::{field.db_type(connection)}" for field in fields]
    values = ", ".join(f"({', '.join(casts)})" for _ in rows)
    params: list[Any] = []
    for row in rows:
        params.append(pk.get_db_prep_save(row.pk, connection))
        params += [f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields]
    quote = connection.ops.quote_name
    columns = ["pk_", *(f.column for f in fields)]
    sets = ", ".join(f"{quote(f.column)} = v.{quote(f.column)}" for f in fields)
    sql = (
        f"UPDATE {quote(CronSchedule._meta.db_table)} AS t SET {sets} "
        f"FROM (VALUES {values}) AS v({', '.join(quote(c) for c in columns)}) "
        f"WHERE t.{quote(pk.column)} = v.{quote('pk_')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
