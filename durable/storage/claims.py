"""Attempts counted before a handler runs, and claims that belong to a lease token.

The promises of DESIGN §5b and §12 that live here:

- **An attempt is counted before its handler runs.** :func:`count_attempts` commits
  ``attempts + 1`` for a batch's due timers in a short transaction of its own, before
  the batch transaction that runs them. A handler that takes its process down
  (``os._exit``, a segfault, the OOM killer) has then used up an attempt all the same,
  and a row that comes due again with every attempt used is dead-lettered instead of
  run: a poison timer takes down at most ``max_attempts`` worker processes in the whole
  cluster. That transaction commits asynchronously on PostgreSQL: the server keeps it
  however the worker dies; only a crash of the database server itself can take the
  count back (and then the timer runs once more than ``max_attempts``).
- **An attempt that never took effect is given back** (:func:`give_back`): when a
  batch's transaction fails and its worker lives on, nothing of it happened; the worker
  (:mod:`durable.worker.attempts`) gives its attempts back, on the condition that the
  row still has the attempts and token it was counted with.
- **A claim belongs to the token it was made under.** A claimed (``firing``) row
  records ``claim_token``. When a worker takes a shard over, it re-runs at once the
  claims of older tokens (:func:`release_stale_claims`): their worker is gone or has
  lost the shard, so waiting for ``CLAIM_TIMEOUT_S`` would only delay them. The old
  owner's late completion is still refused: it is fenced by its stale token, and the
  row has moved on to another attempt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from django.db import connections, transaction

from durable.conf import get_settings
from durable.models import TimerState
from durable.storage import concurrency, statements
from durable.storage.firing import LAZY_COMMIT, due_where, token_by_shard
from durable.storage.leases import fence_shards, ms_to_dt

_FIRING = TimerState.FIRING.value
_PENDING = TimerState.PENDING.value
_FAILED = TimerState.FAILED.value


@dataclass(frozen=True, slots=True, kw_only=True)
class Counted:
    """What :func:`count_attempts` did."""

    stale: dict[int, int | None] = field(default_factory=dict)
    """Shards whose lease is no longer ours (then nothing was counted)."""
    ids: set[int] = field(default_factory=set)
    """Timers whose attempt was counted: the batch may run them."""
    suspects: set[int] = field(default_factory=set)
    """Of ``ids``, pending timers whose previous attempt never recorded an outcome."""
    held: set[int] = field(default_factory=set)
    """Suspects found among other due timers, not counted: the firer runs each alone
    (and counts it then), so a handler that kills its process costs no neighbour an
    attempt again, and a neighbour that does costs the suspect none."""
    attempts: dict[int, int] = field(default_factory=dict)
    """For each of ``ids``, its ``attempts`` once counted (what :func:`give_back` checks)."""
    previous: dict[int, int | None] = field(default_factory=dict)
    """For each of ``ids``, its ``claim_token`` before the count (what :func:`uncount`
    puts back)."""
    locked: set[int] = field(default_factory=set)
    """Due timers another session held locked (PostgreSQL): not counted, not held, and
    not to be taken for timers with every attempt used. The batch leaves them out and
    their runner retries them shortly (:data:`durable.worker.counting.LOCKED_RETRY_MS`)."""


def count_attempts(db: str, tokens: Mapping[int, int], ids: Sequence[int], now_ms: int) -> Counted:
    """Count an attempt for each of ``ids`` that may fire now, under the lease ``tokens``.

    Run in a transaction of its own (:func:`counting`), committed before the handlers
    run. Fenced like the batch: a stale shard means nothing is counted. Rows with every
    attempt used are not counted: the firer dead-letters them. Each counted row records
    the token its attempt started under in ``claim_token`` (every outcome clears it), so
    a pending row found with one set is a *suspect*: an attempt of it started and never
    recorded an outcome, most likely because it took its worker down. A suspect is
    counted only when it is the one timer due of ``ids``; among others it is *held*
    (:attr:`Counted.held`). On PostgreSQL one statement, committed asynchronously.

    On PostgreSQL a due row another session holds locked (a transaction that cancelled
    or rescheduled it and is still open, ``select_for_update()`` in app code) is skipped,
    not waited for: it is reported in :attr:`Counted.locked`, whatever its attempts, and
    nothing else is decided about it. Waiting held the worker's whole fire loop (every
    other shard of the batch, lease renewal included) for as long as that transaction
    lasted. SQLite has one writer and no row locks: nothing is ever skipped there.
    """
    conn = connections[db]
    shards = sorted(tokens)
    where, params = due_where(conn.vendor, shards, ids, now_ms)
    token_of_shard, token_params = token_by_shard(conn.vendor, tokens)
    select = (
        f"SELECT id, state = %s AND claim_token IS NOT NULL AS suspect, attempts + 1 AS n, "
        "claim_token AS previous FROM durable_timer "
        f"WHERE {where} AND attempts < max_attempts"
    )
    update = f"UPDATE durable_timer SET attempts = attempts + 1, claim_token = {token_of_shard}"
    if conn.vendor != "postgresql":
        stale = fence_shards(db, tokens)
        if stale:
            return Counted(stale=stale)
        with statements.cursor(db) as cursor:
            cursor.execute(select, [_PENDING, *params])
            due = cursor.fetchall()
            held = {r[0] for r in due if r[1]} if len(due) > 1 else set()
            rows = [r for r in due if r[0] not in held]
            if rows:
                marks = ", ".join(["%s"] * len(rows))
                cursor.execute(
                    f"{update} WHERE id IN ({marks})", [*token_params, *(r[0] for r in rows)]
                )
        return Counted(
            ids={r[0] for r in rows},
            suspects={r[0] for r in rows if r[1]},
            held=held,
            attempts={r[0]: r[2] for r in rows},
            previous={r[0]: r[3] for r in rows},
        )
    select_all = (
        f"SELECT id, state = %s AND claim_token IS NOT NULL AS suspect, attempts + 1 AS n, "
        "claim_token AS previous, attempts < max_attempts AS countable FROM durable_timer "
        f"WHERE {where}"
    )
    shard_array = statements.int_array(shards)
    tokens_array = statements.int_array(tokens[shard] for shard in shards)
    # The lease rows are share-locked and waited for, never skipped: the fence must see
    # them. The timer rows are locked SKIP LOCKED, every due one (those with every
    # attempt used too, not counted: "countable"), so that a row locked elsewhere is
    # told apart from one that is exhausted: "seen" is the same WHERE without locking,
    # in the same statement (the same snapshot), and what it sees that "due" did not
    # lock was locked by another session. A row that such a session changed and
    # committed between the snapshot and the lock (cancelled, say) also shows there:
    # it is retried shortly and found not due then, which costs one more read. "seen" is
    # read only when "due" locked fewer rows than were asked for (a CTE no part of the
    # statement reads is not run): the ids come from the wheel at their time, so most
    # batches are all due, and the second read cost 0.5 ms a batch of 500.
    sql = (
        "WITH lease AS MATERIALIZED (SELECT shard, token FROM durable_shardlease "
        "WHERE shard = ANY(%s::integer[]) ORDER BY shard FOR SHARE), "
        "fenced AS MATERIALIZED (SELECT NOT EXISTS (SELECT 1 FROM unnest(%s::integer[], "
        "%s::bigint[]) AS ours(shard, token) LEFT JOIN lease USING (shard) "
        "WHERE lease.token IS DISTINCT FROM ours.token) AS ok), "
        f"due AS MATERIALIZED ({select_all} AND (SELECT ok FROM fenced) "
        "FOR UPDATE SKIP LOCKED), "
        f"seen AS MATERIALIZED (SELECT id FROM durable_timer WHERE {where} "
        "AND (SELECT ok FROM fenced)), "
        "held AS MATERIALIZED (SELECT id FROM due WHERE countable AND suspect "
        "AND (SELECT count(*) FROM due WHERE countable) > 1), "
        f"counted AS ({update} FROM due WHERE durable_timer.id = due.id AND due.countable "
        "AND due.id NOT IN (SELECT id FROM held) "
        "RETURNING due.id, due.suspect, due.n, due.previous) "
        "SELECT (SELECT ok FROM fenced), "
        "array(SELECT ARRAY[id, n, previous]::bigint[] FROM counted), "
        "array(SELECT id FROM counted WHERE suspect), array(SELECT id FROM held), "
        "CASE WHEN (SELECT count(*) FROM due) < %s "
        f"THEN array(SELECT id FROM seen EXCEPT SELECT id FROM due) END, {LAZY_COMMIT}"
    )
    with statements.cursor(db) as cursor:
        cursor.execute(
            sql,
            [
                *(shard_array, shard_array, tokens_array),
                *(_PENDING, *params),
                *params,
                *token_params,
                len(set(ids)),
            ],
        )
        ok, counted, suspects, held, locked, _ = cursor.fetchone()
    if not ok:  # which shards: a fence needs a transaction (none in autocommit)
        with transaction.atomic(using=db):
            return Counted(stale=fence_shards(db, tokens))
    attempts = {timer_id: n for timer_id, n, _ in counted}
    previous = {timer_id: token for timer_id, _, token in counted}
    return Counted(
        ids=set(attempts),
        suspects=set(suspects),
        held=set(held),
        attempts=attempts,
        previous=previous,
        locked=set(locked or ()),
    )


def counting(db: str) -> AbstractContextManager[Any]:
    """The transaction :func:`count_attempts` runs and commits in, before the batch.

    On PostgreSQL, in autocommit, none: its one statement is a transaction of its own,
    committed when it returns (asynchronously, as before), which saves the ``BEGIN``,
    ``COMMIT`` and idle-guard round trips of an explicit one (behind a pooler each is a
    trip through it). Elsewhere, or inside a transaction already, ``transaction.atomic``.
    """
    conn = connections[db]
    if conn.vendor == "postgresql" and conn.get_autocommit() and not conn.in_atomic_block:
        return nullcontext()
    atomic: AbstractContextManager[Any] = transaction.atomic(using=db)
    return atomic


def uncount(db: str, previous: Mapping[int, int | None]) -> None:
    """Give back the attempt counted for the ids of ``previous``, which the batch did not
    run after all (left for a later batch, or waiting for a handler thread).

    Each row is put back as the count found it: ``attempts`` one less and its
    ``claim_token`` as it was (``previous``, :attr:`Counted.previous`), so a suspect stays
    a suspect. That holds for a ``firing`` row too: an older owner's expired claim, which
    the batch counted to run again. Giving back only ``pending`` rows left such a row
    with an attempt spent at every batch that left it over, and the chaos run (seed
    20261203) dead-lettered an external timer whose handler had never run. Called in the
    batch transaction, which holds the rows' locks.
    """
    by_token: dict[int | None, list[int]] = {}
    for timer_id, token in previous.items():
        by_token.setdefault(token, []).append(timer_id)
    vendor = connections[db].vendor
    with statements.cursor(db) as cursor:
        for token, ids in sorted(by_token.items(), key=lambda item: (item[0] is None, item[0])):
            where, params = statements.in_clause(vendor, sorted(ids))
            cursor.execute(
                "UPDATE durable_timer SET attempts = attempts - 1, claim_token = %s "
                f"WHERE {where} AND state IN (%s, %s)",
                [token, *params, _PENDING, _FIRING],
            )


def refund_unstarted(db: str, timer_id: int, *, clear: bool) -> bool:
    """Give back the attempt last counted for a pending *suspect* whose handler is external;
    False if the row is not one (any more).

    An external handler runs only after the batch that claims its timer commits, so a
    pending row with ``claim_token`` set and such a handler never started it: its worker
    died between the count and that commit (a neighbour's ``os._exit``, a SIGKILL), and
    that attempt could not have run. Only for plain handler timers: a workflow wake-up
    may have replayed inline in the batch that was cut short. ``clear`` also clears
    ``claim_token`` (the row is no suspect any more): for a row not counted in this
    batch. Called in the batch transaction, which holds the row's lock.
    """
    token_sql = ", claim_token = NULL" if clear else ""
    with statements.cursor(db) as cursor:
        cursor.execute(
            f"UPDATE durable_timer SET attempts = attempts - 1{token_sql} WHERE id = %s "
            "AND state = %s AND kind = %s AND claim_token IS NOT NULL AND attempts > 0",
            [timer_id, _PENDING, "handler"],
        )
        return cursor.rowcount > 0


def give_back(
    db: str, counted: Mapping[int, tuple[int, int]], now_ms: int, *, suspect: bool
) -> int:
    """Give back attempts counted for a batch that never took effect; return how many.

    ``counted`` maps a timer id to ``(attempts, token)``: its ``attempts`` as
    :func:`count_attempts` left them and the lease token they were counted under. A row
    gets its attempt back only if both are still what they were (nothing has counted,
    claimed or finished it since: not a new owner, not this worker's next turn) and it
    is unfinished. ``suspect`` keeps ``claim_token`` set, so the row stays a *suspect*
    and its next attempt runs alone (its handler ran in the batch that failed);
    otherwise it is cleared, as if the attempt had never been counted. A row left
    ``firing`` under the token (the batch's commit went through though the worker saw
    an error: its external claims were never run) has its claim expire at ``now_ms``,
    so it runs again at once rather than after ``CLAIM_TIMEOUT_S``.
    """
    items = sorted(counted.items())
    token_sql = "claim_token" if suspect else "NULL"
    given = 0
    with statements.cursor(db) as cursor:
        for start in range(0, len(items), 100):
            chunk = items[start : start + 100]
            match = " OR ".join(["(id = %s AND attempts = %s AND claim_token = %s)"] * len(chunk))
            cursor.execute(
                f"UPDATE durable_timer SET attempts = attempts - 1, claim_token = {token_sql}, "
                "claim_expires_ms = CASE WHEN state = %s THEN %s ELSE claim_expires_ms END "
                f"WHERE state IN (%s, %s) AND ({match})",
                [
                    _FIRING,
                    now_ms,
                    _PENDING,
                    _FIRING,
                    *(v for i, (n, t) in chunk for v in (i, n, t)),
                ],
            )
            given += cursor.rowcount
    return given


def release_stale_claims(db: str, shard: int, token: int, now_ms: int) -> int:
    """Make ``shard``'s claims of tokens other than ``token`` due now; return how many.

    Called by a new owner right after taking the lease (``token``), before it loads the
    shard: the rescan of the load then finds them due, and they run again at once.
    """
    with statements.cursor(db) as cursor:
        cursor.execute(
            "UPDATE durable_timer SET claim_expires_ms = %s WHERE shard = %s AND state = %s "
            "AND claim_expires_ms > %s AND (claim_token IS NULL OR claim_token <> %s)",
            [now_ms, shard, _FIRING, now_ms, token],
        )
        return cursor.rowcount


def dead_letter(db: str, timer_id: int, token: int, now_ms: int, error: str) -> bool:
    """Move an unfinished timer to failed with ``error``, by id alone; False if finished.

    For a timer whose firing fails in the database whatever its handler does: its own
    columns are all this writes, so it succeeds where the firing's bookkeeping did not
    (and, for a timer of a concurrency key, the key's line: its next timer is woken).
    """
    when = connections[db].ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    with statements.cursor(db) as cursor:
        cursor.execute(
            "UPDATE durable_timer SET state = %s, fired_token = %s, fired_at = %s, "
            "updated_at = %s, claim_expires_ms = NULL, claim_token = NULL, last_error = %s "
            "WHERE id = %s AND state IN (%s, %s)",
            [_FAILED, token, when, when, error[:500], timer_id, _PENDING, _FIRING],
        )
        done = cursor.rowcount > 0
    if done:  # it may have held a slot of its concurrency key: the next in line gets it
        concurrency.release(db, [timer_id], now_ms, get_settings().BUCKET_SHIFT)
    return done
