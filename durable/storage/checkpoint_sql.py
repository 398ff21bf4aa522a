"""The SQL of the one-statement checkpoints on PostgreSQL (see :mod:`durable.storage.checkpoints`).

Builds and runs the statements that fence the shard, lock a running run, update it and
insert its step records in one round trip: the step-record ``INSERT`` (a ``VALUES``
list of parameters), the run's history as JSON, and the column that makes a checkpoint
commit asynchronously when ``ASYNC_COMMIT`` opts in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from durable.conf import get_settings
from durable.exceptions import LeaseLost
from durable.models import WorkflowState
from durable.storage import statements
from durable.storage.leases import ms_to_dt

_ASYNC = "set_config('synchronous_commit', 'off', true)"


def commit_mode() -> str:
    """A SELECT column that makes a checkpoint commit asynchronously when
    ``ASYNC_COMMIT`` opts in (PostgreSQL), else a column that does nothing."""
    return _ASYNC if get_settings().ASYNC_COMMIT else "NULL"


# The run's history as one JSON array, in RETURNING (the row being updated is the run).
HISTORY_SQL = (
    "(SELECT coalesce(json_agg(json_build_object('seq', s.seq, 'kind', s.kind, 'name', s.name, "
    "'status', s.status, 'result', s.result, 'error', s.error, 'attempts', s.attempts, "
    "'wake_ms', s.wake_ms) ORDER BY s.seq), '[]') FROM durable_workflowstep s "
    "WHERE s.run_id = durable_workflowrun.id)"
)


_ROW = (
    "(%s::integer, %s, %s, %s, %s::jsonb, %s, %s::integer, %s::bigint, %s::timestamptz, "
    "%s::integer)"
)


def _insert_sql(run: str, source: str, count: int) -> str:
    """INSERT of ``count`` step records given as parameters (see :func:`_row_params`).

    Parameters rather than one JSON document: the server plans a VALUES list faster than
    it unpacks a document, which a step (one record, the hot path) notices.
    """
    values = ", ".join([_ROW] * count)
    return (
        "INSERT INTO durable_workflowstep (run_id, seq, kind, name, status, result, error, "
        "attempts, wake_ms, started_at, duration_ms, created_at, updated_at) "
        f"SELECT {run}, s.*, %s, %s FROM {source}(VALUES {values}) AS s(seq, kind, name, "
        "status, result, error, attempts, wake_ms, started_at, duration_ms) RETURNING 1"
    )


def jsonb(value: Any) -> str | None:
    """``value`` as a parameter for a ``::jsonb`` placeholder (None is SQL NULL, as the ORM
    stores it)."""
    return None if value is None else json.dumps(value)


def _row_params(inserts: Sequence[dict[str, Any]]) -> list[Any]:
    return [
        value
        for step in inserts
        for value in (
            step["seq"], step["kind"], step["name"], step["status"], jsonb(step["result"]),
            step["error"], step["attempts"], step["wake_ms"], started_at(step),
            step.get("duration_ms"),
        )
    ]  # fmt: skip


def started_at(step: dict[str, Any]) -> datetime | None:
    """When a step record's attempt began, as the ``started_at`` column stores it (None
    for records that are not a live step attempt)."""
    started = step.get("started_ms")
    return None if started is None else ms_to_dt(started)


def added_cte(
    run: str, source: str, inserts: Sequence[dict[str, Any]], when: Any
) -> tuple[str, list[Any]]:
    """The ``added AS (INSERT ...)`` CTE and its parameters; empty without records."""
    if not inserts:
        return "", []
    return f"added AS ({_insert_sql(run, source, len(inserts))})", [
        when,
        when,
        *_row_params(inserts),
    ]


def run_statement(
    db: str,
    run_id: str,
    lease: tuple[int, int] | None,
    set_sql: str,
    set_params: list[Any],
    inserts: Sequence[dict[str, Any]],
    when: Any,
    *,
    tail: tuple[str, list[Any], str] = ("", [], ", 0"),
    commit: str | None = None,
) -> tuple[bool, Any]:
    """One fenced statement on a running run: update it, insert step records, and more.

    ``tail`` is (more CTEs, their parameters, one more SELECT column); ``commit`` an
    extra SELECT column that sets how the transaction commits (default
    :func:`commit_mode`). Returns (the run was
    running and got the update, the tail column); raises LeaseLost.
    """
    added, rows = added_cte("held.id", "held, ", inserts, when)
    added = f", {added}" if added else ""
    ctes, tail_params, tail_column = tail
    if lease is None:  # fenced by the caller's transaction, or unfenced (tests)
        lease_cte, ours, current, shard_params, token_params = "", "TRUE", "NULL", [], []
    else:
        lease_cte = "lease AS (SELECT token FROM durable_shardlease WHERE shard = %s FOR SHARE), "
        ours, current = (
            "(SELECT token FROM lease) IS NOT DISTINCT FROM %s",
            "(SELECT token FROM lease)",
        )
        shard_params, token_params = [lease[0]], [lease[1]]
    sql = (
        f"WITH {lease_cte}held AS (UPDATE durable_workflowrun SET {set_sql} "
        f"WHERE id = %s AND state = %s AND {ours} RETURNING id){added}{ctes} "
        f"SELECT {ours}, (SELECT count(*) FROM held), {current}{tail_column}"
        f"{f', {commit_mode()}' if commit is None else commit}"
    )
    params = [*shard_params, *set_params, run_id, WorkflowState.RUNNING, *token_params, *rows,
              *tail_params, *token_params]  # fmt: skip
    with statements.cursor(db) as cursor:
        cursor.execute(sql, params)
        is_ours, found, token, extra = cursor.fetchone()[:4]
    if not is_ours:
        assert lease is not None
        raise LeaseLost(
            f"lease of shard {lease[0]} lost: token {lease[1]} is stale (now {token})",
            shard=lease[0],
            token=lease[1],
            current_token=token,
        )
    return bool(found), extra
