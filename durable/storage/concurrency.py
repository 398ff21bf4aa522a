"""Concurrency keys: admit a key's timers up to its limit, park the rest, wake them in order.

A handler declared with ``concurrency_key``/``max_concurrency`` stores each timer's key
(``Timer.concurrency_key``) and routes the timer to the key's shard, so one owner, under
its lease token, decides for the key. A key's *active* timers are its rows in state
``firing`` (claimed, their handler running or about to); nothing else is counted, so
the count cannot drift from the rows it describes.

- :func:`admit` runs in the firing batch's fenced transaction. It locks the key's row
  (:class:`~durable.limits.ConcurrencyKey`) before counting, so two transactions never
  decide for one key at once and commits landing out of order cannot admit more than
  the limit. A timer over the limit is *parked*: still pending, due at
  :data:`PARKED_MS` (never, until woken), with ``queued_ms`` its place in line (the
  time it first came due). It holds no wheel entry and is never rescanned: no polling.
- :func:`release` runs in the transaction that records an active timer's end (fired,
  retried, dead-lettered). It locks the key's row and makes the oldest parked timers due
  now, as many as there are free slots. A woken timer keeps its place (``queued_ms``)
  and holds its slot until it fires: a timer that came due later cannot take it.

Lock order: timer rows (the batch's, or the completing one), then key rows by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.db import connections

from durable.core.sharding import bucket_of
from durable.limits import ConcurrencyKey
from durable.models import TimerState
from durable.storage import statements
from durable.storage.notify import notify_timers

#: 9999-12-31T23:59:59.999Z: a parked timer's due time ("when a slot frees").
PARKED_MS = 253_402_300_799_999

_PENDING = TimerState.PENDING.value
_FIRING = TimerState.FIRING.value

#: (shard, timer id, fire_at_ms) of a timer made due, for the owner's wheel.
Woken = tuple[int, int, int]


def admit(db: str, limits: Mapping[int, int], now_ms: int, bucket_shift: int) -> set[int]:
    """Decide admission for a batch's keyed timers; park those over their key's limit.

    ``limits`` maps each due, counted timer of a limited handler to its
    ``max_concurrency``. Returns the ids parked (their counted attempt given back); the
    others may fire. A row firing already (a claim re-run after its worker died) holds
    its slot and is always admitted. Call inside the batch's fenced transaction.
    """
    rows = _keyed_rows(db, list(limits))
    by_key: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_key.setdefault(row[1], []).append(row)
    key_limits = {key: max(limits[row[0]] for row in group) for key, group in by_key.items()}
    _lock_keys(db, list(key_limits), key_limits)
    parked: list[int] = []
    admitted_in_line: list[int] = []
    woken: list[Woken] = []
    for key in sorted(by_key):
        group = by_key[key]
        active, reserved, waiting = _counts(db, key, [row[0] for row in group])
        free = key_limits[key] - active - reserved
        # Firing rows first (they hold a slot), then the line: its place, then id.
        group.sort(key=lambda r: (r[2] != _FIRING, r[3] if r[3] is not None else r[4], r[0]))
        for timer_id, _, state, queued_ms, _fire_at, _shard in group:
            # A timer new to the line goes behind those parked in it already.
            if state == _FIRING or (free > 0 and (queued_ms is not None or not waiting)):
                free -= 1
                if queued_ms is not None:
                    admitted_in_line.append(timer_id)
            else:
                parked.append(timer_id)
        if free > 0 and waiting:
            woken += _wake(db, key, free, now_ms, bucket_shift)
    _park(db, parked, bucket_shift)
    _leave_line(db, admitted_in_line)
    notify_timers(db, woken)
    return set(parked)


def release(db: str, timer_ids: Iterable[int], now_ms: int, bucket_shift: int) -> list[Woken]:
    """Wake the oldest parked timers of the keys of ``timer_ids``, which just ended.

    Call in the transaction that records their end, fenced by the keys' shard owner's
    token. Returns the timers made due (also announced by NOTIFY at commit).
    """
    ids = list(timer_ids)
    keys = sorted({row[1] for row in _keyed_rows(db, ids)})
    if not keys:
        return []
    limits = _lock_keys(db, keys, None)
    woken: list[Woken] = []
    for key in keys:
        active, reserved, waiting = _counts(db, key, [])
        free = limits.get(key, 0) - active - reserved
        if free > 0 and waiting:
            woken += _wake(db, key, free, now_ms, bucket_shift)
    notify_timers(db, woken)
    return woken


def _keyed_rows(db: str, ids: list[int]) -> list[tuple[Any, ...]]:
    """``(id, concurrency_key, state, queued_ms, fire_at_ms, shard)`` of the keyed ``ids``."""
    if not ids:
        return []
    where, params = statements.in_clause(connections[db].vendor, ids)
    with statements.cursor(db) as cursor:
        cursor.execute(
            "SELECT id, concurrency_key, state, queued_ms, fire_at_ms, shard FROM durable_timer "
            f"WHERE {where} AND concurrency_key IS NOT NULL",
            params,
        )
        return list(cursor.fetchall())


def _lock_keys(db: str, names: list[str], limits: Mapping[str, int] | None) -> dict[str, int]:
    """Lock the rows of keys ``names`` in name order; return each one's limit.

    With ``limits`` (admission), missing rows are created first and each row's limit is
    set to the handler's current one; without (a finish), the stored limit is read.
    """
    names = sorted(names)
    if limits is not None:
        new = [ConcurrencyKey(name=name, max_concurrency=limits[name]) for name in names]
        ConcurrencyKey.objects.using(db).bulk_create(new, ignore_conflicts=True)
    rows = ConcurrencyKey.objects.using(db).filter(name__in=names).order_by("name")
    if connections[db].features.has_select_for_update:
        rows = rows.select_for_update()
    stored = dict(rows.values_list("name", "max_concurrency"))
    if limits is None:
        return stored
    for name in names:
        if stored.get(name) != limits[name]:
            ConcurrencyKey.objects.using(db).filter(name=name).update(max_concurrency=limits[name])
    return dict(limits)


def _wake(db: str, key: str, count: int, now_ms: int, bucket_shift: int) -> list[Woken]:
    """Make the ``count`` oldest parked timers of ``key`` due now; return them."""
    with statements.cursor(db) as cursor:
        cursor.execute(
            "SELECT id, shard FROM durable_timer WHERE concurrency_key = %s AND state = %s "
            "AND fire_at_ms >= %s ORDER BY queued_ms, id LIMIT %s",
            [key, _PENDING, PARKED_MS, count],
        )
        rows = cursor.fetchall()
    if not rows:
        return []
    where, params = statements.in_clause(connections[db].vendor, [row[0] for row in rows])
    with statements.cursor(db) as cursor:
        cursor.execute(
            f"UPDATE durable_timer SET fire_at_ms = %s, bucket = %s WHERE {where}",
            [now_ms, bucket_of(now_ms, bucket_shift), *params],
        )
    return [(shard, timer_id, now_ms) for timer_id, shard in rows]


def _park(db: str, ids: list[int], bucket_shift: int) -> None:
    """Park ``ids`` (see the module docstring) and give back the attempt counted for them."""
    if not ids:
        return
    where, params = statements.in_clause(connections[db].vendor, ids)
    with statements.cursor(db) as cursor:
        cursor.execute(
            "UPDATE durable_timer SET queued_ms = COALESCE(queued_ms, fire_at_ms), "
            "fire_at_ms = %s, bucket = %s, attempts = attempts - 1, claim_token = NULL "
            f"WHERE {where} AND state = %s",
            [PARKED_MS, bucket_of(PARKED_MS, bucket_shift), *params, _PENDING],
        )


def _leave_line(db: str, ids: list[int]) -> None:
    """Admitted timers that waited in line leave it (a later retry is a new arrival)."""
    if not ids:
        return
    where, params = statements.in_clause(connections[db].vendor, ids)
    with statements.cursor(db) as cursor:
        cursor.execute(f"UPDATE durable_timer SET queued_ms = NULL WHERE {where}", params)


def _counts(db: str, key: str, exclude: list[int]) -> tuple[int, int, int]:
    """(active, woken and not yet fired, parked) of ``key``, leaving ``exclude`` out."""
    vendor = connections[db].vendor
    where, params = statements.in_clause(vendor, exclude or [0])
    sql = (
        "SELECT "
        "COALESCE(SUM(CASE WHEN state = %s THEN 1 ELSE 0 END), 0), "
        "COALESCE(SUM(CASE WHEN state = %s AND queued_ms IS NOT NULL AND fire_at_ms < %s "
        "THEN 1 ELSE 0 END), 0), "
        "COALESCE(SUM(CASE WHEN state = %s AND fire_at_ms >= %s THEN 1 ELSE 0 END), 0) "
        f"FROM durable_timer WHERE concurrency_key = %s AND state IN (%s, %s) AND NOT ({where})"
    )
    args = [_FIRING, _PENDING, PARKED_MS, _PENDING, PARKED_MS, key, _FIRING, _PENDING, *params]
    with statements.cursor(db) as cursor:
        cursor.execute(sql, args)
        active, reserved, waiting = cursor.fetchone()
    return int(active), int(reserved), int(waiting)
