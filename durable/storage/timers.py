"""Queries of the scheduling path: insert timers, find them by key, cancel, follow up.

Everything runs on the alias it is given, inside the caller's transaction: nothing here
commits on its own, so a schedule or cancel in a transaction that rolls back leaves no
trace (DESIGN §4). Idempotency keys rest on the unique index of ``Timer.key``: an insert
runs in a savepoint and, on a unique violation, the existing row is returned. On
PostgreSQL the second inserter waits on the index for the first transaction's outcome,
so two concurrent callers with the same key end up with one row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

from django.db import IntegrityError, transaction
from django.db.models.base import ModelState
from django.db.models.constants import OnConflict
from django.db.models.signals import post_init, pre_init

from durable.conf import DurableSettings, get_settings
from durable.core.sharding import bucket_of, shard_for, shard_of_timer

# The registry is plain data (no ORM, no Django); the follow-up takes its retry policy
# from the on_complete handler's declaration, so storage reads it here.
from durable.dispatch.registry import handlers
from durable.models import Timer, TimerKind, TimerState
from durable.storage import concurrency
from durable.storage.bulk import bulk_insert
from durable.storage.leases import ms_to_dt
from durable.storage.notify import notify_shards, notify_timers

_PENDING = TimerState.PENDING.value
# Stay well under SQLite's bound-variable limit in ``IN (...)`` lists.
_CHUNK = 500


class Completed(Protocol):
    """What :func:`create_followup` needs of a finished timer (a ``Timer`` or the worker's row)."""

    @property
    def id(self) -> int: ...
    @property
    def shard(self) -> int: ...
    @property
    def on_complete(self) -> str: ...
    @property
    def context(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class _Canceled:
    id: int
    shard: int
    on_complete: str
    context: Any


def insert_timer(db: str, timer: Timer) -> tuple[Timer, bool]:
    """Insert an unsaved timer; with a key that exists, return that row instead.

    Returns ``(timer, created)``. Nothing is written when the key exists.
    """
    if timer.key is None:
        timer.save(using=db, force_insert=True)
        return timer, True
    if insert_if_absent(db, timer):
        return timer, True
    # On PostgreSQL the unique index made us wait for a concurrent inserter, and its row
    # is committed (visible to this next statement) by the time we get here.
    existing = by_keys(db, [timer.key]).get(timer.key)
    if existing is None:
        # SQLite's INSERT OR IGNORE also skips a row that breaks NOT NULL or CHECK.
        raise IntegrityError(f"timer with key {timer.key!r} was neither inserted nor found")
    return existing, False


def insert_if_absent(db: str, timer: Timer) -> bool:
    """``INSERT ... ON CONFLICT DO NOTHING RETURNING id``; False if the key exists.

    One statement instead of a look-up, a savepoint, the insert and its release: it runs
    for every keyed schedule(), every follow-up and workflow wake-up, and every cron
    occurrence's next timer, often inside a firing batch. It goes through the ORM's
    insert query (what ``save()`` and ``bulk_create()`` use), so columns, defaults and
    ``auto_now`` stamps stay Django's.
    """
    fields = [f for f in Timer._meta.concrete_fields if not f.primary_key]
    rows = Timer.objects.using(db)._insert(
        [timer], fields=fields, returning_fields=[Timer._meta.pk], on_conflict=OnConflict.IGNORE
    )
    if not rows or rows[0] is None:
        return False
    timer.pk = rows[0][0]
    timer._state.adding = False
    timer._state.db = db
    return True


def new_pending(
    conf: DurableSettings, *, fire_at_ms: int, key: str | None = None, **fields: Any
) -> Timer:
    """An unsaved pending timer due at ``fire_at_ms``, routed by ``key``.

    Its shard comes from the key (a random one without a key) and its bucket from the
    due time: the columns every scheduling path derives the same way. A timer with a
    ``concurrency_key`` is routed by that instead: its key's shard owner decides its
    admission (:mod:`durable.storage.concurrency`).
    """
    routing = fields.get("concurrency_key")
    return new_timer(
        shard=shard_of_timer(key, conf.SHARDS)
        if routing is None
        else shard_for(routing, conf.SHARDS),
        bucket=bucket_of(fire_at_ms, conf.BUCKET_SHIFT),
        fire_at_ms=fire_at_ms,
        state=TimerState.PENDING,
        key=key,
        **fields,
    )


def new_timer(**fields: Any) -> Timer:
    """Return an unsaved ``Timer`` with ``fields`` (attnames, e.g. ``parent_id``) set.

    Equivalent to ``Timer(**fields)`` at a tenth of the cost, which matters at 100k
    timers a call: the instance dict is filled directly, as ``Model.__init__`` would
    fill it. If anything listens to ``pre_init``/``post_init`` for ``Timer``, the
    ordinary constructor runs, so those listeners never miss an instance.
    """
    defaults, factories = _layout()
    if (pre_init.receivers or post_init.receivers) and (
        pre_init.has_listeners(Timer) or post_init.has_listeners(Timer)
    ):
        values = {**defaults, **{name: make() for name, make in factories}, **fields}
        return Timer(**{name: value for name, value in values.items() if name != "id"})
    timer = Timer.__new__(Timer)
    state = timer.__dict__
    state.update(defaults)
    state.update(fields)
    for name, make in factories:
        if name not in fields:
            state[name] = make()  # a fresh list/dict per timer, never a shared one
    state["_state"] = ModelState()
    return timer


@cache
def _layout() -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    concrete = Timer._meta.concrete_fields
    defaults = {f.attname: None if f.primary_key else f.get_default() for f in concrete}
    factories = [
        (f.attname, f.default) for f in concrete if f.has_default() and callable(f.default)
    ]
    return defaults, factories


def insert_many(db: str, timers: Sequence[Timer]) -> list[Timer]:
    """Insert unsaved timers (no pk) with one INSERT statement; return the rows, in order.

    Keys are expected to be new (look them up with :func:`by_keys` first). If another
    transaction inserted one meanwhile, the keyed timers are inserted one by one,
    idempotently, and the existing row takes that timer's place in the result.
    """
    if not any(t.key is not None for t in timers):
        bulk_insert(db, timers)
        return list(timers)
    try:
        with transaction.atomic(using=db):
            bulk_insert(db, timers)
        return list(timers)
    except IntegrityError:
        pass
    bulk_insert(db, [t for t in timers if t.key is None])
    return [t if t.key is None else insert_timer(db, t)[0] for t in timers]


def by_keys(db: str, keys: Iterable[str]) -> dict[str, Timer]:
    """Return the existing timers with these idempotency keys, by key."""
    found: dict[str, Timer] = {}
    for chunk in _chunks(list(keys)):
        found.update((t.key, t) for t in Timer.objects.using(db).filter(key__in=chunk))
    return found


def insert_many_if_absent(db: str, timers: list[Timer]) -> set[str]:
    """:func:`insert_if_absent` for keyed timers in one statement; return the keys that were new."""
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


def get_timer(db: str, timer_id: int, *, kind: str | None = None) -> Timer | None:
    """The timer ``timer_id`` (of ``kind``, when given), or None."""
    rows = Timer.objects.using(db).filter(pk=timer_id)
    return (rows.filter(kind=kind) if kind is not None else rows).first()


def claimed_timer(db: str, timer_id: int, attempt: int, *, lock: bool) -> Timer | None:
    """The timer if a claim on ``attempt`` stands (state firing); row-locked when asked."""
    rows = Timer.objects.using(db).filter(pk=timer_id, state=TimerState.FIRING, attempts=attempt)
    return (rows.select_for_update() if lock else rows).first()


def start_execution(db: str, timer_id: int, attempt: int, token: int) -> str:
    """An executor takes a shipped claim: ``"started"``, ``"died"`` or ``"other"``.

    ``"started"``: the claim (that attempt, claimed under ``token``) is now marked taken
    (``claim_token`` = ``-token``, committed before the handler runs). ``"died"``: it was
    marked taken already, so the message is a redelivery after the executor that took it
    died (with it, perhaps). ``"other"``: not a claim this shipment can mark (gone, or
    claimed before claims recorded a token): run as before.
    """
    rows = Timer.objects.using(db).filter(pk=timer_id, state=TimerState.FIRING, attempts=attempt)
    if rows.filter(claim_token=token).update(claim_token=-token):
        return "started"
    if rows.filter(claim_token=-token).exists():
        return "died"
    return "other"


def store_result(db: str, timer_id: int, result: Any) -> None:
    """Overwrite the timer's ``result`` (a JSON value), nothing else."""
    Timer.objects.using(db).filter(pk=timer_id).update(result=result)


def missing_ids(db: str, ids: Iterable[int]) -> set[int]:
    """Return those of ``ids`` that are not timers."""
    wanted = set(ids)
    for chunk in _chunks(list(wanted)):
        wanted -= set(Timer.objects.using(db).filter(id__in=chunk).values_list("id", flat=True))
    return wanted


#: A bulk write announces up to this many near-term timers one by one (one payload:
#: each notice is about 28 bytes of the 7,900 a payload holds); beyond it, one "rescan
#: shard" notice per shard. Notices by id go straight into the owner's wheel, a rescan
#: costs the owner a query per shard: small batches (a web request scheduling a few
#: timers, a producer committing every few milliseconds) are cheaper announced by id.
PER_TIMER_NOTICES = 256


def announce(db: str, timers: Iterable[Timer], now_ms: int, *, per_shard: bool = False) -> None:
    """NOTIFY the owning workers of the near-term ones among new ``timers``.

    Delivered when the current transaction commits, never if it rolls back. Far-future
    timers are not announced: workers load them by bucket when they come into range.
    ``per_shard`` (bulk writes) sends one "rescan shard" notice per shard instead of one
    per timer when more than :data:`PER_TIMER_NOTICES` timers are near.
    """
    conf = get_settings()
    if not conf.NOTIFY:
        return
    horizon = now_ms + (conf.HORIZON_BUCKETS << conf.BUCKET_SHIFT)
    near = [t for t in timers if t.fire_at_ms < horizon and t.state == _PENDING]
    if per_shard and len(near) > PER_TIMER_NOTICES:
        notify_shards(db, {t.shard for t in near})
    else:
        notify_timers(db, [(t.shard, t.pk, t.fire_at_ms) for t in near])


def cancel_cascade(db: str, timer_id: int, now_ms: int) -> bool:
    """Cancel a pending timer and its pending descendants; follow up each one cancelled.

    Returns True only if this call moved ``timer_id`` from pending to canceled; if it
    did not, nothing else is touched. The walk goes through every child, whatever its
    state, so a child that already fired does not shield its own pending children.
    The conditional UPDATE makes it race-safe: a worker firing a timer holds its row
    lock, so we wait for its outcome and then find it no longer pending.
    """
    with transaction.atomic(using=db, savepoint=False):
        if not _set_canceled(db, [timer_id], now_ms):
            return False
        done = _fetch_canceled(Timer.objects.using(db).filter(id=timer_id))
        seen, level = {timer_id}, [timer_id]
        while level:
            cancelled, others = _children(db, level)
            _set_canceled(db, [row.id for row in cancelled], now_ms)
            done += cancelled
            level = [i for i in [row.id for row in cancelled] + others if i not in seen]
            seen.update(level)  # parent links are acyclic by construction; be sure anyway
        for row in done:
            create_followup(row, {"status": "canceled"}, now_ms, using=db)
        # One woken in its concurrency key's line held a slot: the next in line gets it.
        concurrency.release(db, [row.id for row in done], now_ms, get_settings().BUCKET_SHIFT)
    return True


def _children(db: str, parents: list[int]) -> tuple[list[_Canceled], list[int]]:
    """Return the pending children of ``parents`` (now locked) and the ids of the others."""
    pending: list[_Canceled] = []
    others: list[int] = []
    for chunk in _chunks(parents):
        children = Timer.objects.using(db).filter(parent_id__in=chunk)
        # Lock before updating, so the UPDATE hits exactly the rows reported cancelled.
        pending += _fetch_canceled(children.select_for_update().filter(state=_PENDING))
        others += children.exclude(state=_PENDING).values_list("id", flat=True)
    return pending, others


def create_followup(
    timer: Completed, result: Any, now_ms: int, *, using: str | None = None
) -> Timer | None:
    """Schedule ``timer.on_complete`` now with ``{timer_id, context, result}``; idempotent.

    ``result`` is ``{"status": "success", "value": ...}``, ``{"status": "failed", "error":
    ...}`` or ``{"status": "canceled"}`` and must be JSON. The follow-up runs on the same
    shard, under key ``on_complete:<id>``, so a second call returns the first follow-up.
    Returns ``None`` when the timer has no ``on_complete``.
    """
    if not timer.on_complete:
        return None
    conf = get_settings()
    db = using or conf.DATABASE
    max_attempts, base_s, max_s = _policy(timer.on_complete)
    followup = Timer(
        shard=timer.shard,
        bucket=bucket_of(now_ms, conf.BUCKET_SHIFT),
        fire_at_ms=now_ms,
        kind=TimerKind.HANDLER,
        target=timer.on_complete,
        kwargs={"timer_id": timer.id, "context": timer.context, "result": result},
        key=f"on_complete:{timer.id}",
        max_attempts=max_attempts,
        backoff_base_s=base_s,
        backoff_max_s=max_s,
    )
    with transaction.atomic(using=db, savepoint=False):
        followup, created = insert_timer(db, followup)
        if created:
            announce(db, [followup], now_ms)
    return followup


def _policy(name: str) -> tuple[int, float, float]:
    conf = get_settings()
    # A lookup, never an import (the name is row data). An unknown name still gets its
    # follow-up: firing it fails visibly (dead letter, with the reason), which beats
    # losing the completion of the timer that did run.
    spec = handlers.get(name)
    backoff = spec.backoff if spec else None
    return (
        (spec.max_attempts if spec else None) or conf.MAX_ATTEMPTS,
        backoff.base_s if backoff else conf.BACKOFF_BASE_S,
        backoff.max_s if backoff else conf.BACKOFF_MAX_S,
    )


def _set_canceled(db: str, ids: list[int], now_ms: int) -> int:
    # ``update()`` skips auto_now; stamp updated_at (with the caller's clock, as firing
    # does) since retention pruning of cancelled rows goes by it.
    count = 0
    when = ms_to_dt(now_ms)
    for chunk in _chunks(ids):
        count += (
            Timer.objects.using(db)
            .filter(id__in=chunk, state=_PENDING)
            .update(state=TimerState.CANCELED, updated_at=when)
        )
    return count


def _fetch_canceled(rows: Any) -> list[_Canceled]:
    fields = ("id", "shard", "on_complete", "context")
    return [_Canceled(*values) for values in rows.values_list(*fields)]


def _chunks(items: list[Any]) -> Iterator[list[Any]]:
    for start in range(0, len(items), _CHUNK):
        yield items[start : start + _CHUNK]
