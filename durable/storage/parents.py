"""Queries about a new timer's parent: a child of a cancelled parent is born cancelled.

Runs in the scheduling transaction, between planning and the insert
(:func:`durable.scheduling.api.schedule`, ``schedule_many``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from django.db import connections

from durable.models import Timer, TimerState
from durable.storage.timers import create_followup

_CHUNK = 500


def cancel_if_parent_canceled(db: str, timers: Sequence[Timer]) -> list[Timer]:
    """Make those of unsaved ``timers`` whose parent is cancelled cancelled; return them.

    A child scheduled under a cancelled parent is born cancelled and never fires. A
    fired or failed parent leaves its children pending (a handler may schedule
    follow-ups of its own timer).

    Why a lock: the parents' rows are read in id order with ``FOR SHARE`` (PostgreSQL),
    held to the end of the caller's transaction. It conflicts with the lock that
    :func:`~durable.storage.timers.cancel_cascade` takes on every timer it cancels and
    lets other schedulers in. Either the cancel committed first, and the parent reads
    cancelled here, or the cancel waits for this transaction and then finds the new
    child, which it cancels: the cascade locks each pending descendant before its UPDATE
    and reads the next level afterwards. Re-checking after the insert would not do: a
    cancel committing after the re-check cannot see the uncommitted child. The lock is
    the kind ``cancel()`` already holds until the caller commits; the worker waits for
    it only to fire that parent. SQLite runs one writer at a time: a plain read is enough.
    """
    parent_ids = sorted({t.parent_id for t in timers if t.parent_id is not None})
    cancelled = canceled_among(db, parent_ids)
    born = [t for t in timers if t.parent_id in cancelled]
    for timer in born:
        timer.state = TimerState.CANCELED
    return born


def canceled_among(db: str, parent_ids: Sequence[int]) -> set[int]:
    """Return those of ``parent_ids`` that are cancelled, their rows locked ``FOR SHARE``
    on PostgreSQL to the end of the caller's transaction (see above for why)."""
    cancelled: set[int] = set()
    if not parent_ids:
        return cancelled
    conn = connections[db]
    for start in range(0, len(parent_ids), _CHUNK):
        chunk = list(parent_ids[start : start + _CHUNK])
        if conn.vendor == "postgresql":
            # No condition on state: a row is locked (and waited for) whatever its state,
            # and the state read is the one current once the lock is ours.
            with conn.cursor() as cursor:
                cursor.execute(
                    "SELECT id, state FROM durable_timer WHERE id = ANY(%s) ORDER BY id FOR SHARE",
                    [chunk],
                )
                rows = cursor.fetchall()
        else:
            query = Timer.objects.using(db).filter(id__in=chunk).order_by("id")
            if conn.features.has_select_for_update:
                query = query.select_for_update()
            rows = list(query.values_list("id", "state"))
        cancelled.update(pk for pk, state in rows if state == TimerState.CANCELED)
    return cancelled


def follow_up_born_canceled(db: str, born: Iterable[Timer], now_ms: int) -> None:
    """Give the ``born`` cancelled timers that were inserted their ``on_complete``
    follow-up (``{"status": "canceled"}``), as a cascade would. One not inserted (its
    key was taken: that row was returned instead) has no id and is skipped."""
    for timer in born:
        if timer.pk is not None and timer.on_complete:
            create_followup(timer, {"status": "canceled"}, now_ms, using=db)
