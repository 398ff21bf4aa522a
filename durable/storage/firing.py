"""Queries of the fire path: load a shard's near-term timers, lock due ones, record outcomes.

Loading reads only ``(id, fire_at_ms)`` over the partial index of pending rows, so a new
owner rebuilds a shard quickly; payloads are read at fire time, in batches
(:func:`lock_due`). Every write here runs inside a transaction that the caller fenced
with :func:`durable.storage.leases.fence`.

The per-batch queries (:func:`lock_due`, :func:`mark_fired`) are raw SQL rather than ORM
chains: at thousands of timers a second, building a 500-placeholder ``IN (...)`` query in
Python and turning each row into a model-shaped dict cost more than the database work.
On PostgreSQL the ids travel as one array parameter (``= ANY(%s::bigint[])``), which
keeps the statement text constant and the primary-key index in use.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from django.db import connections

from durable.core.sharding import bucket_of
from durable.models import Timer, TimerState
from durable.storage import statements
from durable.storage.leases import fence_shards, ms_to_dt

_PENDING = TimerState.PENDING.value
_FIRING = TimerState.FIRING.value
_FIRED = TimerState.FIRED.value


class DueTimer(NamedTuple):
    """What the firer needs of a locked, due timer.

    A NamedTuple built straight from the row (``_make``), not the usual frozen dataclass:
    one is built per fired timer, and a keyword-only frozen dataclass cost ten times as
    much. The JSON columns stay as fetched and are decoded when read (``args``,
    ``kwargs``, ``context``): most timers carry none, and most never need ``context``.
    """

    id: int
    kind: str
    target: str
    args_json: Any
    kwargs_json: Any
    key: str | None
    attempts: int
    max_attempts: int
    backoff_base_s: float
    backoff_max_s: float
    fire_at_ms: int
    on_complete: str
    context_json: Any
    shard: int

    @property
    def args(self) -> list[Any]:
        """Positional arguments for the handler (a new list at every read)."""
        return [] if self.args_json == "[]" else _json(self.args_json)

    @property
    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the handler (a new dict at every read)."""
        return {} if self.kwargs_json == "{}" else _json(self.kwargs_json)

    @property
    def context(self) -> Any:
        """The ``context`` given at scheduling time, handed to ``on_complete``."""
        return _json(self.context_json)


# Column order matches DueTimer's fields.
_DUE_COLUMNS = (
    "id, kind, target, args, kwargs, key, attempts, max_attempts, backoff_base_s, "
    "backoff_max_s, fire_at_ms, on_complete, context, shard"
)

# The batch queries select rows by primary key only. A condition such as "state IN
# ('pending', 'firing')" or "shard = %s AND state = 'pending'" lets the planner pick the
# state or pending index instead, and with statistics that lag a burst of new timers
# (autovacuum analyzes a minute later) it did: every batch of 500 then walked all the
# shard's pending rows, and the fire rate halved at random. "state NOT IN (finished
# states)" is the same set (the five states are closed) and no btree index can serve it.
_FINISHED = (TimerState.FIRED.value, TimerState.FAILED.value, TimerState.CANCELED.value)
_NOT_FINISHED = "state NOT IN (%s, %s, %s)"
# A new state must be put on one side of that line (or these queries rewritten).
assert {*_FINISHED, _PENDING, _FIRING} == set(TimerState.values), "see _NOT_FINISHED"


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
    It deliberately does not filter on ids seen before: ids commit out of order. One
    statement (a ``UNION ALL`` of the two reads): every shard rescans every
    ``RESCAN_INTERVAL_S``, and each statement is a round trip of the fire loop.
    """
    return _fetch(
        db,
        "SELECT id, fire_at_ms FROM durable_timer "
        "WHERE shard = %s AND state = %s AND bucket <= %s AND fire_at_ms <= %s "
        "UNION ALL SELECT id, claim_expires_ms FROM durable_timer "
        "WHERE shard = %s AND state = %s AND claim_expires_ms <= %s",
        [shard, _PENDING, bucket_of(upto_ms, bucket_shift), upto_ms, shard, _FIRING, upto_ms],
    )


def _fetch(db: str, sql: str, params: list[Any]) -> list[tuple[int, int]]:
    # Both columns are bigint: the driver already returns ints, and a rebuild reads a
    # million rows, so no per-row conversion here.
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def lock_due(db: str, shards: Sequence[int], ids: Sequence[int], now_ms: int) -> list[DueTimer]:
    """Lock and return those of ``ids`` in ``shards`` that may fire now, oldest first.

    A row may fire when it is still pending, or firing with an expired claim. Rows
    cancelled, already fired, or in a shard the caller did not fence are skipped
    silently: the wheel holds ids only, and the row is the truth.
    """
    conn = connections[db]
    select, params = _due(conn.vendor, shards, ids, now_ms)
    lock = " FOR UPDATE" if conn.features.has_select_for_update else ""
    with statements.cursor(db) as cursor:
        cursor.execute(f"{select} ORDER BY fire_at_ms, id{lock}", params)
        rows = cursor.fetchall()
    return list(map(DueTimer._make, rows))


def fence_and_lock_due(
    db: str, tokens: Mapping[int, int], ids: Sequence[int], now_ms: int
) -> tuple[dict[int, int | None], list[DueTimer]]:
    """Fence the batch's shards and lock its due timers: (stale shards, due timers).

    :func:`~durable.storage.leases.fence_shards` then :func:`lock_due`, as one statement
    on PostgreSQL when anything is due: the lease rows are share-locked and their tokens
    checked before any timer row is locked, and a stale token locks none. When nothing
    comes back (nothing due, or a stale lease), the plain fence says which, so the
    result is the same as the two calls'. Stale shards non-empty means nothing locked.
    It is the batch transaction's first statement: the worker's idle guard sets its
    timeout in it (:data:`~durable.storage.statements.IDLE_GUARD`). It waits on a timer
    row another session holds locked: the firer leaves out the rows the count just
    before found locked (:attr:`durable.storage.claims.Counted.locked`), so only a lock
    taken between the two statements is waited for.
    """
    shards = sorted(tokens)
    if connections[db].vendor != "postgresql":
        stale = fence_shards(db, tokens)
        return stale, ([] if stale else lock_due(db, shards, ids, now_ms))
    select, params = _due("postgresql", shards, ids, now_ms)
    shard_array = statements.int_array(shards)
    sql = (
        "WITH lease AS MATERIALIZED (SELECT shard, token FROM durable_shardlease "
        f"WHERE shard = ANY(%s::integer[]) AND {statements.IDLE_GUARD} IS NOT NULL "
        f"ORDER BY shard FOR SHARE) {select} "
        "AND NOT EXISTS (SELECT 1 FROM unnest(%s::integer[], %s::bigint[]) AS ours(shard, "
        "token) LEFT JOIN lease USING (shard) WHERE lease.token IS DISTINCT FROM ours.token) "
        "ORDER BY fire_at_ms, id FOR UPDATE OF durable_timer"
    )
    tokens_array = statements.int_array(tokens[shard] for shard in shards)
    with statements.cursor(db) as cursor:
        cursor.execute(sql, [shard_array, *params, shard_array, tokens_array])
        rows = cursor.fetchall()
    if rows:
        return {}, list(map(DueTimer._make, rows))
    return fence_shards(db, tokens), []


def _due(
    vendor: str, shards: Sequence[int], ids: Sequence[int], now_ms: int
) -> tuple[str, list[Any]]:
    """``SELECT`` of the rows of ``ids`` in ``shards`` that may fire now, and its params."""
    where, params = due_where(vendor, shards, ids, now_ms)
    return f"SELECT {_DUE_COLUMNS} FROM durable_timer WHERE {where}", params


def due_where(
    vendor: str, shards: Sequence[int], ids: Sequence[int], now_ms: int
) -> tuple[str, list[Any]]:
    """The ``WHERE`` condition of the rows of ``ids`` in ``shards`` that may fire now."""
    where, params = statements.in_clause(vendor, ids)
    in_shards, shard_params = statements.in_clause(vendor, shards, "shard", "integer")
    # "pending and due, or firing with an expired claim", spelled so that only the
    # primary key can serve the query (see _NOT_FINISHED): state in {pending, firing},
    # and then due or a claim that expired (a NULL claim compares unknown: not due). The
    # fire_at_ms test keeps "never early" even if a row's time moved after the wheel
    # loaded its id; the rescan puts such an id back at its new time.
    sql = (
        f"{where} AND {in_shards} AND {_NOT_FINISHED} AND ((state = %s AND fire_at_ms <= %s) "
        "OR claim_expires_ms <= %s)"
    )
    return sql, [*params, *shard_params, *_FINISHED, _PENDING, now_ms, now_ms]


def _json(value: Any) -> Any:
    # JSON columns arrive as text on every backend (Django installs a text loader for
    # jsonb); anything else was decoded already.
    return json.loads(value) if isinstance(value, str | bytes) else value


def mark_fired(
    db: str,
    ids: Iterable[int],
    tokens: Mapping[int, int],
    now_ms: int,
    results: dict[int, Any] | None = None,
) -> None:
    """Record successful fires (one UPDATE for all ids; results stored where given).

    ``tokens`` maps each shard the ids belong to → the fencing token the fire committed
    under, stored as ``fired_token``: the proof of which owner fired a row. The attempt
    was counted before its handler ran (:func:`durable.storage.claims.count_attempts`).
    ``updated_at`` is stamped because retention pruning goes by it.
    """
    ids = list(ids)
    if not ids:
        return
    conn = connections[db]
    where, params = statements.in_clause(conn.vendor, ids)
    when = conn.ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    token_of_shard, token_params = token_by_shard(conn.vendor, tokens)
    with statements.cursor(db) as cursor:
        cursor.execute(
            f"UPDATE durable_timer SET state = %s, fired_token = {token_of_shard}, "
            "fired_at = %s, updated_at = %s, claim_expires_ms = NULL, claim_token = NULL, "
            f"last_error = '' WHERE {where} AND {_NOT_FINISHED}",
            [_FIRED, *token_params, when, when, *params, *_FINISHED],
        )
    store_results(db, results or {})


def store_results(db: str, results: Mapping[int, Any]) -> None:
    """Store the results of fired timers (an ``on_complete`` reads its timer's)."""
    for timer_id, result in results.items():
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
        claim_token=None,
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
        updated_at=ms_to_dt(now_ms),  # retention goes by it
        claim_expires_ms=None,
        claim_token=None,
        last_error=error,
    )


def claim(
    db: str,
    ids: Iterable[int],
    tokens: Mapping[int, int],
    claim_expires_ms: int,
    *,
    durable: bool = True,
) -> None:
    """Mark external fires as running until ``claim_expires_ms``, under the lease ``tokens``.

    ``tokens`` maps each shard of ``ids`` to the lease token the claim is made under,
    stored as ``claim_token``: a new owner of the shard re-runs claims of older tokens at
    once (:func:`durable.storage.claims.release_stale_claims`). The attempt was counted
    before (:func:`durable.storage.claims.count_attempts`).

    ``durable=False`` lets the transaction commit asynchronously on PostgreSQL: for a
    batch that wrote nothing but claims. A claim lost to a database crash leaves its
    timer pending, to fire again; the handler's own writes come later in the log, so
    none of them can survive without it.
    """
    ids = list(ids)
    if not ids:
        return
    conn = connections[db]
    sql, params = claim_sql(conn.vendor, ids, tokens, claim_expires_ms)
    if not durable and conn.vendor == "postgresql":
        sql = f"WITH claimed AS ({sql} RETURNING 1) SELECT count(*), {LAZY_COMMIT} FROM claimed"
    with statements.cursor(db) as cursor:
        cursor.execute(sql, params)


#: A SELECT column that makes the transaction commit asynchronously (PostgreSQL).
LAZY_COMMIT = "set_config('synchronous_commit', 'off', true)"


def claim_sql(
    vendor: str, ids: Sequence[int], tokens: Mapping[int, int], claim_expires_ms: int
) -> tuple[str, list[Any]]:
    """The UPDATE that claims ``ids`` (see :func:`claim`), for a statement of one's own."""
    where, params = statements.in_clause(vendor, ids)
    token_of_shard, token_params = token_by_shard(vendor, tokens)
    return (
        f"UPDATE durable_timer SET state = %s, claim_expires_ms = %s, "
        f"claim_token = {token_of_shard} WHERE {where}",
        [_FIRING, claim_expires_ms, *token_params, *params],
    )


def token_by_shard(vendor: str, tokens: Mapping[int, int]) -> tuple[str, list[Any]]:
    """An SQL expression of a row's ``shard`` giving its token in ``tokens``, and its params.

    On PostgreSQL one statement text whatever the shards (two array parameters).
    """
    shards = sorted(tokens)
    if vendor == "postgresql":
        array = statements.int_array
        return "(%s::bigint[])[array_position(%s::integer[], shard)]", [
            array(tokens[shard] for shard in shards),
            array(shards),
        ]
    expression = "CASE shard " + "WHEN %s THEN %s " * len(shards) + "END"
    return expression, [v for shard in shards for v in (shard, tokens[shard])]


def complete_claim(
    db: str, timer_id: int, attempts: int, shard: int, token: int, now_ms: int
) -> bool:
    """Mark a claimed timer fired from inside its handler's last transaction.

    For external handlers that commit their own transactions (a workflow replay): its
    final checkpoint and the fire commit together, which saves the firer a transaction.
    Only while our claim (that attempt number) stands; False otherwise. The caller's
    transaction must be fenced with ``token``. On PostgreSQL it is made to commit
    synchronously (its earlier statements may have asked otherwise): a fired timer is
    never lost. Results are not stored: meant for timers without ``on_complete``.
    """
    conn = connections[db]
    when = conn.ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    sync = ", set_config('synchronous_commit', 'on', true)" if conn.vendor == "postgresql" else ""
    with statements.cursor(db) as cursor:
        cursor.execute(
            "UPDATE durable_timer SET state = %s, fired_token = %s, fired_at = %s, "
            "updated_at = %s, claim_expires_ms = NULL, claim_token = NULL, last_error = '' "
            f"WHERE id = %s AND state = %s AND attempts = %s RETURNING id{sync}",
            [_FIRED, token, when, when, timer_id, _FIRING, attempts],
        )
        return cursor.fetchone() is not None


def still_claimed(db: str, timer_id: int, attempts: int) -> bool:
    """Lock the row and tell whether our claim (that attempt number) still stands."""
    return (
        Timer.objects.using(db)
        .select_for_update()
        .filter(id=timer_id, state=_FIRING, attempts=attempts)
        .exists()
    )


def retention_cutoff_ms(now_ms: int, days: float) -> int:
    """The instant before which finished rows may be pruned."""
    return now_ms - int(timedelta(days=days).total_seconds() * 1000)
