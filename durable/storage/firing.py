"""Queries of the fire path: load a shard's near-term timers, lock due ones, record outcomes.

Loading reads only ``(id, fire_at_ms)`` over the partial index of pending rows, so a new
owner rebuilds a shard quickly; payloads are read at fire time, in batches
(:func:`lock_due`). Every write here runs inside a transaction that the caller fenced
with :func:`durable.storage.leases.fence`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connections
from django.db.models import F, Q

from durable.core.sharding import bucket_of
from durable.models import Timer, TimerState
from durable.storage.leases import ms_to_dt

_PENDING = TimerState.PENDING.value
_FIRING = TimerState.FIRING.value


@dataclass(frozen=True, slots=True, kw_only=True)
class DueTimer:
    """What the firer needs of a locked, due timer."""

    id: int
    kind: str
    target: str
    args: list[Any]
    kwargs: dict[str, Any]
    key: str | None
    attempts: int
    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    fire_at_ms: int
    on_complete: str
    context: Any
    shard: int


_DUE_FIELDS = [f.name for f in DueTimer.__dataclass_fields__.values()]  # type: ignore[attr-defined]


def load_window(db: str, shard: int, after_bucket: int, upto_bucket: int) -> list[tuple[int, int]]:
    """Pending ``(id, fire_at_ms)`` of ``shard`` with ``after_bucket < bucket <= upto_bucket``."""
    sql = (
        "SELECT id, fire_at_ms FROM durable_timer "
        "WHERE shard = %s AND state = %s AND bucket > %s AND bucket <= %s"
    )
    return _fetch(db, sql, [shard, _PENDING, after_bucket, upto_bucket])


def rescan_due_soon(db: str, shard: int, upto_ms: int, bucket_shift: int) -> list[tuple[int, int]]:
    """Everything of ``shard`` that is or becomes due by ``upto_ms``.

    Pending rows in any bucket up to ``upto_ms`` (so overdue rows from a past outage are
    included), and external fires whose claim expires by then, at their claim expiry.
    It deliberately does not filter on ids seen before: ids commit out of order.
    """
    pending = _fetch(
        db,
        "SELECT id, fire_at_ms FROM durable_timer "
        "WHERE shard = %s AND state = %s AND bucket <= %s AND fire_at_ms <= %s",
        [shard, _PENDING, bucket_of(upto_ms, bucket_shift), upto_ms],
    )
    reclaim = _fetch(
        db,
        "SELECT id, claim_expires_ms FROM durable_timer "
        "WHERE shard = %s AND state = %s AND claim_expires_ms <= %s",
        [shard, _FIRING, upto_ms],
    )
    return pending + reclaim


def _fetch(db: str, sql: str, params: list[Any]) -> list[tuple[int, int]]:
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        return [(int(a), int(b)) for a, b in cursor.fetchall()]


def lock_due(db: str, shard: int, ids: Sequence[int], now_ms: int) -> list[DueTimer]:
    """Lock and return those of ``ids`` that may fire now, oldest first.

    A row may fire when it is still pending, or firing with an expired claim. Rows
    cancelled, already fired, or moved to another shard are skipped silently: the wheel
    holds ids only, and the row is the truth.
    """
    rows = (
        Timer.objects.using(db)
        .select_for_update()
        .filter(id__in=list(ids), shard=shard)
        .filter(Q(state=_PENDING) | Q(state=_FIRING, claim_expires_ms__lte=now_ms))
        .order_by("fire_at_ms", "id")
        .values_list(*_DUE_FIELDS)
    )
    return [DueTimer(**dict(zip(_DUE_FIELDS, row, strict=True))) for row in rows]


def mark_fired(
    db: str, ids: Iterable[int], token: int, now_ms: int, results: dict[int, Any] | None = None
) -> None:
    """Record successful fires (one UPDATE for all ids; results stored where given)."""
    ids = list(ids)
    if not ids:
        return
    values = {
        "state": TimerState.FIRED,
        "fired_token": token,
        "fired_at": ms_to_dt(now_ms),
        # update() skips auto_now: stamp it, retention and "recent fires" go by it.
        "updated_at": ms_to_dt(now_ms),
        "claim_expires_ms": None,
        "last_error": "",
    }
    qs = Timer.objects.using(db).filter(id__in=ids)
    qs.filter(state=_PENDING).update(attempts=F("attempts") + 1, **values)
    qs.filter(state=_FIRING).update(**values)  # attempts were counted at claim time
    for timer_id, result in (results or {}).items():
        Timer.objects.using(db).filter(id=timer_id).update(result=result)


def mark_retry(
    db: str, timer: DueTimer, attempts: int, fire_at_ms: int, bucket_shift: int, error: str
) -> None:
    """Put a failed timer back to pending at ``fire_at_ms`` with its attempt counted."""
    Timer.objects.using(db).filter(id=timer.id).update(
        state=TimerState.PENDING,
        attempts=attempts,
        fire_at_ms=fire_at_ms,
        bucket=bucket_of(fire_at_ms, bucket_shift),
        claim_expires_ms=None,
        last_error=error,
    )


def mark_failed(
    db: str, timer: DueTimer, attempts: int, token: int, now_ms: int, error: str
) -> None:
    """Dead-letter a timer that used up its attempts (or can never succeed)."""
    Timer.objects.using(db).filter(id=timer.id).update(
        state=TimerState.FAILED,
        attempts=attempts,
        fired_token=token,
        fired_at=ms_to_dt(now_ms),
        updated_at=ms_to_dt(now_ms),
        claim_expires_ms=None,
        last_error=error,
    )


def claim(db: str, ids: Iterable[int], claim_expires_ms: int) -> None:
    """Mark external fires as running until ``claim_expires_ms`` (attempt counted now)."""
    Timer.objects.using(db).filter(id__in=list(ids)).update(
        state=TimerState.FIRING, claim_expires_ms=claim_expires_ms, attempts=F("attempts") + 1
    )


def still_claimed(db: str, timer_id: int, attempts: int) -> bool:
    """Lock the row and tell whether our claim (that attempt number) still stands."""
    return (
        Timer.objects.using(db)
        .select_for_update()
        .filter(id=timer_id, state=_FIRING, attempts=attempts)
        .exists()
    )


def prune_finished(db: str, older_than_ms: int, batch: int = 1000) -> int:
    """Delete up to ``batch`` fired/cancelled rows last updated before ``older_than_ms``."""
    cutoff = ms_to_dt(older_than_ms)
    ids = list(
        Timer.objects.using(db)
        .filter(state__in=[TimerState.FIRED, TimerState.CANCELED], updated_at__lt=cutoff)
        .order_by("updated_at")
        .values_list("id", flat=True)[:batch]
    )
    if not ids:
        return 0
    # Children keep their rows; their parent link is cleared by on_delete=SET_NULL.
    deleted, _ = Timer.objects.using(db).filter(id__in=ids).delete()
    return deleted


def retention_cutoff_ms(now_ms: int, days: float) -> int:
    """The instant before which finished rows may be pruned."""
    return now_ms - int(timedelta(days=days).total_seconds() * 1000)
