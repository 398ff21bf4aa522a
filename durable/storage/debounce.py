"""The query behind ``schedule(..., key=..., debounce=..., max_wait=...)``.

One debounced timer per key: a call finds the row that holds the key and, in the
caller's transaction,

- **none**: inserts the new timer (``debounce_since_ms`` = now);
- **pending**: moves it later and gives it the call's arguments. A timer whose due time
  changes gets a **new row** (the old one is deleted), for the reason
  :mod:`durable.scheduling.operations` gives: a worker's wheel holds the old id at the
  old time and ignores a notice for an id it holds, so an in-place move would only be
  seen at the next rescan. The deleted id pops out of the wheel at the old time and
  finds no row (the fire path reads rows, never the wheel's time). Deleting instead of
  cancelling keeps a burst of 10,000 calls at one row, not 10,000 cancelled ones. A
  timer whose due time stays (held at its ``max_wait`` bound) is updated in place;
- **firing, fired, failed or cancelled**, or pending with an attempt under way (its
  ``claim_token`` is set: a worker counted an attempt and is about to run it, or died
  running it, see :mod:`durable.storage.claims`): the burst it belonged to is over (its
  handler may have read the state before this call's change), so the old row gives the
  key up (its ``key`` becomes NULL; nothing else changes) and a new timer starts a new
  burst. Moving a row whose attempt was counted would carry over an attempt that never
  ran (a timer with ``max_attempts=1`` would be dead-lettered unrun) or drop the mark of
  one that took its worker down.

Races (PostgreSQL): the row is read ``FOR UPDATE``, so two callers debouncing one key
take turns on it; a caller that finds no row inserts with ``ON CONFLICT DO NOTHING``,
which waits on the unique index for a concurrent inserter's outcome. A caller whose row
vanished (moved or released by the other caller, who committed) reads again: it then
sees the other caller's new row and debounces that one. So two writers always end with
exactly one pending timer for the key, and neither call is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connections

from durable.conf import get_settings
from durable.core.sharding import bucket_of
from durable.models import Timer, TimerState
from durable.storage.leases import ms_to_dt
from durable.storage.timers import announce, insert_if_absent

#: How many times a call reads the key's row again after losing a race for it. Each
#: retry means another transaction committed a change to that key meanwhile; under READ
#: COMMITTED the next read sees it, so a handful is plenty. Under REPEATABLE READ or
#: SERIALIZABLE PostgreSQL raises a serialization failure at the conflict (checked by
#: hand); should a database not, the call ends ``"contended"`` instead of looping forever.
MAX_TRIES = 20

# Copied from the row being replaced: its attempts so far (a timer waiting for a retry
# keeps counting towards max_attempts, so a poison handler is still dead-lettered) and
# the error that made it retry.
_KEPT = ("attempts", "last_error")
# What a call may change in place when the due time stays.
_UPDATED = (
    "args",
    "kwargs",
    "max_attempts",
    "backoff_base_s",
    "backoff_max_s",
    "on_complete",
    "context",
    "debounce_since_ms",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Debounced:
    """What :func:`debounce` did: ``outcome`` and the timer as it now stands.

    ``outcome``: ``"created"`` (a new burst), ``"moved"`` (a pending timer got a later
    time: a new row), ``"updated"`` (a pending timer kept its time: same row),
    ``"conflict"`` (the key holds a timer of another kind or handler: ``timer`` is that
    one, nothing was written) or ``"contended"`` (see :data:`MAX_TRIES`).
    """

    outcome: str
    timer: Timer | None


def debounce(
    db: str, planned: Timer, *, debounce_ms: int, max_wait_ms: int | None, now_ms: int
) -> Debounced:
    """Debounce ``planned`` (unsaved, keyed, due at now + ``debounce_ms``) under its key.

    Runs in the caller's transaction and writes nothing on ``"conflict"``. The timer is
    never moved earlier: it is due at the latest of its current time and now +
    ``debounce_ms``, but not after ``debounce_since_ms + max_wait_ms`` unless its current
    time already is. Announces a new row to its worker (NOTIFY on commit).
    """
    rows = Timer.objects.using(db)
    for _ in range(MAX_TRIES):
        current = rows.select_for_update().filter(key=planned.key).first()
        if current is None:
            planned.debounce_since_ms = now_ms
            if insert_if_absent(db, planned):
                announce(db, [planned], now_ms)
                return Debounced(outcome="created", timer=planned)
            continue  # a concurrent caller inserted the key and committed: take its row
        if current.kind != planned.kind or current.target != planned.target:
            return Debounced(outcome="conflict", timer=current)
        if current.state != TimerState.PENDING or current.claim_token is not None:
            planned.debounce_since_ms = now_ms
            _take_key(db, current, planned)  # the finished burst lets go of it
            announce(db, [planned], now_ms)
            return Debounced(outcome="created", timer=planned)
        return _move(db, current, planned, debounce_ms, max_wait_ms, now_ms)
    return Debounced(outcome="contended", timer=None)


def _move(
    db: str, current: Timer, planned: Timer, debounce_ms: int, max_wait_ms: int | None, now_ms: int
) -> Debounced:
    """Give the locked pending ``current`` the call's arguments and its later due time."""
    # A pending timer scheduled without debounce= joins the burst now.
    since = current.debounce_since_ms if current.debounce_since_ms is not None else now_ms
    due = now_ms + debounce_ms
    if max_wait_ms is not None:
        due = min(due, since + max_wait_ms)
    due = max(due, current.fire_at_ms)  # never earlier than a previous call asked
    planned.debounce_since_ms = since
    rows = Timer.objects.using(db)
    if due == current.fire_at_ms:
        changes = {name: getattr(planned, name) for name in _UPDATED}
        changes["updated_at"] = ms_to_dt(now_ms)
        rows.filter(pk=current.pk).update(**changes)
        for name, value in changes.items():
            setattr(current, name, value)
        return Debounced(outcome="updated", timer=current)
    planned.fire_at_ms = due
    planned.bucket = bucket_of(due, get_settings().BUCKET_SHIFT)
    for name in _KEPT:
        setattr(planned, name, getattr(current, name))
    # One plain DELETE frees the key (the ORM's delete() would also read the row and
    # unlink its children first); the children are linked to the new row just after,
    # and the parent foreign key is checked at commit (Django makes it deferrable).
    with connections[db].cursor() as cursor:
        cursor.execute(f"DELETE FROM {Timer._meta.db_table} WHERE id = %s", [current.pk])
    if not insert_if_absent(db, planned):  # cannot happen: we held the key's only row
        raise RuntimeError(f"debounce: key {planned.key!r} was taken while its row was locked")
    # Children follow, so that cancelling the timer still cascades to them.
    rows.filter(parent_id=current.pk).update(parent_id=planned.pk)
    announce(db, [planned], now_ms)
    return Debounced(outcome="moved", timer=planned)


def _take_key(db: str, current: Timer, planned: Timer) -> None:
    """Insert ``planned`` under the key ``current`` (locked) holds, which lets go first."""
    Timer.objects.using(db).filter(pk=current.pk).update(key=None)  # the key is unique
    # Cannot fail: a concurrent inserter of the key waits on the index entry of
    # ``current``, whose update this transaction holds.
    if not insert_if_absent(db, planned):
        raise RuntimeError(f"debounce: key {planned.key!r} was taken while its row was locked")
