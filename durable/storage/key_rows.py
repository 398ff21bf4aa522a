"""The concurrency keys' rows (:class:`~durable.limits.ConcurrencyKey`): locked, read, written.

What :mod:`durable.storage.concurrency` decides with, apart from the decisions: a key's
row is locked (in name order) before its timers are counted, so two transactions never
decide for one key at once; on PostgreSQL the lock and the count go in one pipeline
(:func:`lock_and_count`). :class:`Key` is one locked key while a transaction decides for
it; :func:`save_logs` writes back the rate logs that changed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.db import connections

from durable.core.ratelimit import Rate, parse_rate
from durable.limits import ConcurrencyKey
from durable.storage import key_counts, statements

#: A handler's ``(max_concurrency, rate)``: either may be ``None`` (no such limit).
Limits = tuple[int | None, Rate | None]

#: A key's row as stored: its limit, its rate's text and its rate log.
Stored = tuple[int | None, str, list[int]]


class Key:
    """One locked key's limits and state while a transaction decides for it."""

    def __init__(self, limit: int | None, rate: Rate | None, log: list[int]) -> None:
        self.limit = limit
        self.rate = rate
        self.log = log
        self.logged = False  # the log changed: write it back

    def free(self, active: int, reserved: int) -> float:
        """Slots free for new starts (infinite without ``max_concurrency``)."""
        return INFINITE if self.limit is None else self.limit - active - reserved

    def room(self, now_ms: int) -> float:
        """Starts the rate allows at ``now_ms`` (infinite without a rate)."""
        return INFINITE if self.rate is None else self.rate.room(self.log, now_ms)

    def started(self, now_ms: int) -> None:
        if self.rate is not None:
            self.log = self.rate.record(self.log, now_ms)
            self.logged = True


INFINITE = float("inf")


def keyed_rows(db: str, ids: list[int]) -> list[tuple[Any, ...]]:
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


def lock_and_count(
    db: str, ids: list[int], *, ended: bool = False, active: bool = True
) -> tuple[list[tuple[Any, ...]], dict[str, Stored] | None, dict[str, tuple[int, int, int]]]:
    """:func:`keyed_rows` of ``ids``; on PostgreSQL their keys' rows locked and counted too.

    On PostgreSQL, two statements in one round trip (a pipeline), so that the decision
    costs the batch one wait for the server before its handlers start, not three:

    - the keyed rows joined to their key's row, locked in name order (``FOR UPDATE OF``
      the key; the timer rows are the batch's, locked already). A timer whose key has no
      row yet is not in the join: it is read apart, and :func:`lock_keys` creates and
      locks its key (the caller then counts again, under that lock);
    - :func:`~durable.storage.key_counts.counts` of those keys, a workflow's key with its
      runs (the statement tells the keys apart by name). The server runs it once the
      first has its locks, and takes its snapshot then: it sees every commit made before
      the locks were granted, as a second round trip would. One statement could not:
      its snapshot is taken before it waits for the locks.

    ``active``: as :func:`~durable.storage.key_counts.counts`'. ``ended``: ``ids`` ended
    (:func:`release`): they are counted as they now are, not
    left out as a batch's are; a timer whose key has no row is not read (nobody waits
    in a line no batch decided for). Elsewhere (or with a driver that cannot pipeline)
    the keyed rows alone, ``None`` and ``{}``: :func:`lock_keys` locks and the caller
    counts.
    """
    conn = connections[db]
    if not ids or conn.vendor != "postgresql" or not statements.can_pipeline():
        return keyed_rows(db, ids), None, {}
    count_sql, count_args = key_counts.counts_sql(
        conn.vendor, None, [] if ended else ids, workflow=True, keys_of=ids, active=active
    )
    # The cursors first: they open the connection the pipeline is entered on.
    with statements.cursor(db) as lock, statements.cursor(db) as count:
        with conn.wrap_database_errors, conn.connection.pipeline():
            lock.execute(
                "SELECT t.id, t.concurrency_key, t.state, t.queued_ms, t.fire_at_ms, "
                "t.shard, k.max_concurrency, k.rate_limit, k.recent FROM durable_timer t "
                "JOIN durable_concurrencykey k ON k.name = t.concurrency_key "
                "WHERE t.id = ANY(%s::bigint[]) ORDER BY k.name, t.id FOR UPDATE OF k",
                [statements.int_array(ids)],
            )
            count.execute(count_sql, count_args)
        # Read once the pipeline is done (its end waits for both results): a fetch inside
        # it would wait for them too, and the end would then cost a round trip of its own.
        joined = lock.fetchall()
        counted = key_counts.read(count.fetchall())
    rows = [row[:6] for row in joined]
    locked: dict[str, Stored] = {}
    for row in joined:
        if row[1] not in locked:
            locked[row[1]] = (row[6], row[7], json_list(row[8]))
    if ended:
        return rows, locked, counted
    found = {row[0] for row in rows}
    rest = [timer_id for timer_id in ids if timer_id not in found]
    return rows + keyed_rows(db, rest), locked, counted


def lock_keys(
    db: str, policies: Mapping[str, Limits | None], locked: dict[str, Stored] | None = None
) -> dict[str, Key]:
    """Lock the rows of ``policies``' keys in name order and return them.

    A policy (admission) creates a missing row and updates its limits to the handler's
    current ones; ``None`` (an end) reads the stored ones. Rows are never deleted, so the
    insert is only tried for names the lock did not find (once per key, in practice).
    ``locked``: the rows this transaction locked already (:func:`lock_and_count`);
    only the others are looked for.
    """
    names = sorted(policies)
    if locked is None:
        rows = locked_rows(db, names)
    else:
        rows = {name: locked[name] for name in names if name in locked}
    missing = [name for name in names if name not in rows and policies[name] is not None]
    if missing:
        new = []
        for name in missing:
            limit, rate = as_stored(policies[name])  # type: ignore[arg-type]
            new.append(ConcurrencyKey(name=name, max_concurrency=limit, rate_limit=rate))
        ConcurrencyKey.objects.using(db).bulk_create(new, ignore_conflicts=True)
        rows.update(locked_rows(db, missing))
    keys = {}
    for name, (limit, rate, log) in rows.items():
        policy = policies[name]
        if policy is not None and as_stored(policy) != (limit, rate):
            limit, rate = as_stored(policy)
            ConcurrencyKey.objects.using(db).filter(name=name).update(
                max_concurrency=limit, rate_limit=rate
            )
        keys[name] = Key(limit, parse_rate(rate) if rate else None, log)
    return keys


def locked_rows(db: str, names: list[str]) -> dict[str, Stored]:
    """Lock the existing rows of ``names`` (in name order); their limits and rate log."""
    conn = connections[db]
    if conn.vendor == "postgresql":
        where, params = "name = ANY(%s::text[])", [list(names)]
    else:
        where, params = f"name IN ({', '.join(['%s'] * len(names))})", list(names)
    lock = " FOR UPDATE" if conn.features.has_select_for_update else ""
    with statements.cursor(db) as cursor:
        cursor.execute(
            "SELECT name, max_concurrency, rate_limit, recent FROM durable_concurrencykey "
            f"WHERE {where} ORDER BY name{lock}",
            params,
        )
        rows = cursor.fetchall()
    return {name: (limit, rate, json_list(log)) for name, limit, rate, log in rows}


def json_list(value: Any) -> list[int]:
    # JSON columns arrive as text on every backend (see durable.storage.firing._json).
    return list(json.loads(value) if isinstance(value, str | bytes) else value or [])


def as_stored(limits: Limits) -> tuple[int | None, str]:
    """As stored: the limit, and the rate's text (``""`` for none)."""
    return limits[0], "" if limits[1] is None else limits[1].text


def save_logs(db: str, keys: Mapping[str, Key]) -> None:
    """Write back the rate logs that changed (one statement on PostgreSQL)."""
    changed = sorted((name, json.dumps(key.log)) for name, key in keys.items() if key.logged)
    if not changed:
        return
    with statements.cursor(db) as cursor:
        if connections[db].vendor == "postgresql":
            cursor.execute(
                "UPDATE durable_concurrencykey AS k SET recent = v.log::jsonb "
                "FROM unnest(%s::text[], %s::text[]) AS v(name, log) WHERE k.name = v.name",
                [[name for name, _ in changed], [log for _, log in changed]],
            )
            return
        for name, log in changed:
            cursor.execute(
                "UPDATE durable_concurrencykey SET recent = %s WHERE name = %s", [log, name]
            )
