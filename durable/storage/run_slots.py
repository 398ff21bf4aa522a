"""Queries of workflow runs' concurrency slots (see :mod:`durable.workflows.slots`).

A run of a limited workflow stores its key (``WorkflowRun.concurrency_key``) and so do
the timers that start it (its start, a retry). The firer admits those timers like a
handler's (:func:`durable.storage.concurrency.admit`); what holds a slot is counted by
:func:`durable.storage.key_counts.counts`. Every transaction that ends a keyed run
(completed, failed, cancelled, its wake-up dead-lettered) calls :func:`release_runs`
after writing the end, which makes the next in the key's line due.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import connections

from durable.storage import concurrency, statements


def keyed_starts(db: str, timer_ids: list[int]) -> dict[int, str]:
    """Of the workflow timers ``timer_ids``, those with a concurrency key: timer id → the
    workflow name of its run (whose declaration gives the limits)."""
    if not timer_ids:
        return {}
    where, params = statements.in_clause(connections[db].vendor, timer_ids)
    with statements.cursor(db) as cursor:
        cursor.execute(
            "SELECT t.id, r.name FROM durable_timer t JOIN durable_workflowrun r "
            f"ON r.id = t.target WHERE t.{where} AND t.concurrency_key IS NOT NULL",
            params,
        )
        return {int(timer_id): name for timer_id, name in cursor.fetchall()}


def release_runs(
    db: str, run_ids: Iterable[str], now_ms: int, bucket_shift: int
) -> list[concurrency.Woken]:
    """The runs ``run_ids`` just ended: wake the next in their keys' lines.

    Call in the transaction that wrote their end, after it. Runs without a key cost one
    indexed read (none when ``run_ids`` is empty).
    """
    ids = sorted(set(run_ids))
    if not ids:
        return []
    if connections[db].vendor == "postgresql":
        where, params = "id = ANY(%s::text[])", [ids]
    else:
        where, params = f"id IN ({', '.join(['%s'] * len(ids))})", list(ids)
    with statements.cursor(db) as cursor:
        cursor.execute(
            f"SELECT DISTINCT concurrency_key FROM durable_workflowrun WHERE {where} "
            "AND concurrency_key IS NOT NULL",
            params,
        )
        names = [row[0] for row in cursor.fetchall()]
    return concurrency.release_keys(db, names, now_ms, bucket_shift) if names else []
