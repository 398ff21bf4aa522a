"""Queries of a replay's checkpoints: start the replay, record steps, suspend, finish.

Each checkpoint is a short transaction the replay opens itself (and fences). The hot path
(one step = one checkpoint) is shaped for round trips: on PostgreSQL, locking the run,
checking it still runs and inserting the step records is one statement, and so is
starting a replay. Other databases get the same effects through the ORM.

Checkpoint transactions commit asynchronously on PostgreSQL (``synchronous_commit``
off, for that transaction only). That is safe here, and only here: the wake-up timer
that started the replay stays claimed until the firer marks it fired, in a synchronous
commit that flushes the WAL up to itself, checkpoints included. If the database crashes
before that, the claim expires and the replay runs again from what was flushed; a worker
crash loses nothing, since the server has every commit. A step then costs round trips,
not a disk flush.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections

from durable.models import WorkflowRun, WorkflowSignal, WorkflowState, WorkflowStep
from durable.storage.leases import ms_to_dt

STEP_FIELDS = ("seq", "kind", "name", "status", "result", "error", "attempts", "wake_ms")
ACTIVE = WorkflowRun.ACTIVE_STATES
_RUN_FIELDS = ("name", "shard", "args", "kwargs", "model_label", "object_pk", "parent_id")
_ASYNC = "set_config('synchronous_commit', 'off', true)"
# The run's history as one JSON array, in RETURNING (the row being updated is the run).
_HISTORY = (
    "(SELECT coalesce(json_agg(json_build_object('seq', s.seq, 'kind', s.kind, 'name', s.name, "
    "'status', s.status, 'result', s.result, 'error', s.error, 'attempts', s.attempts, "
    "'wake_ms', s.wake_ms) ORDER BY s.seq), '[]') FROM durable_workflowstep s "
    "WHERE s.run_id = durable_workflowrun.id)"
)


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    """What a replay needs of a run, read when it starts."""

    id: str
    name: str
    shard: int
    args: list[Any]
    kwargs: dict[str, Any]
    model_label: str
    object_pk: str
    parent_id: str | None
    steps: list[dict[str, Any]]


def _postgres(db: str) -> bool:
    return connections[db].vendor == "postgresql"


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def begin(db: str, run_id: str, now_ms: int) -> RunSnapshot | None:
    """Mark an unfinished run running and read it with its history; None if finished.

    On PostgreSQL one statement: the history comes back in the same row, as JSON.
    """
    connection = connections[db]
    extra = f", {_HISTORY}, {_ASYNC}" if _postgres(db) else ""
    placeholders = ", ".join(["%s"] * len(ACTIVE))
    sql = (
        "UPDATE durable_workflowrun SET state = %s, replays = replays + 1, updated_at = %s "
        f"WHERE id = %s AND state IN ({placeholders}) RETURNING {', '.join(_RUN_FIELDS)}{extra}"
    )
    when = connection.ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    with connection.cursor() as cursor:
        cursor.execute(sql, [WorkflowState.RUNNING, when, run_id, *ACTIVE])
        row = cursor.fetchone()
    if row is None:
        return None
    name, shard, args, kwargs, model_label, object_pk, parent_id = row[: len(_RUN_FIELDS)]
    if extra:
        steps = _json(row[len(_RUN_FIELDS)])
    else:
        rows = WorkflowStep.objects.using(db).filter(run_id=run_id).order_by("seq")
        steps = list(rows.values(*STEP_FIELDS))
    return RunSnapshot(
        id=run_id,
        name=name,
        shard=shard,
        args=_json(args),
        kwargs=_json(kwargs),
        model_label=model_label,
        object_pk=object_pk,
        parent_id=parent_id,
        steps=steps,
    )


def hold(db: str, run_id: str, now_ms: int) -> bool:
    """Lock the run for this checkpoint; False if it is no longer running (cancelled)."""
    return bool(
        WorkflowRun.objects.using(db)
        .filter(pk=run_id, state=WorkflowState.RUNNING)
        .update(updated_at=ms_to_dt(now_ms))
    )


def commit_steps(
    db: str,
    run_id: str,
    inserts: Sequence[dict[str, Any]],
    updates: Sequence[dict[str, Any]],
    now_ms: int,
    *,
    held: bool,
) -> bool:
    """Write step records and make the transaction commit asynchronously.

    Unless the run was ``held`` earlier in this transaction, first lock it and check it
    still runs: False means it stopped (cancelled) and nothing was written; the caller
    rolls back.
    """
    when = ms_to_dt(now_ms)
    for step in updates:
        values = {k: v for k, v in step.items() if k != "seq"}
        WorkflowStep.objects.using(db).filter(run_id=run_id, seq=step["seq"]).update(
            **values, updated_at=when
        )
    if not _postgres(db):
        if not held and not hold(db, run_id, now_ms):
            return False
        WorkflowStep.objects.using(db).bulk_create(
            [WorkflowStep(run_id=run_id, created_at=when, updated_at=when, **s) for s in inserts]
        )
        return True
    return _insert(db, run_id, inserts, now_ms, held=held)


_INSERT = (
    "INSERT INTO durable_workflowstep (run_id, seq, kind, name, status, result, error, "
    "attempts, wake_ms, created_at, updated_at) "
    "SELECT {run}, s.seq, s.kind, s.name, s.status, s.result, s.error, s.attempts, "
    "s.wake_ms, %s, %s FROM {source}jsonb_to_recordset(%s::jsonb) AS s(seq integer, "
    "kind text, name text, status text, result jsonb, error text, attempts integer, "
    "wake_ms bigint) RETURNING 1"
)


def _insert(
    db: str, run_id: str, inserts: Sequence[dict[str, Any]], now_ms: int, *, held: bool
) -> bool:
    connection = connections[db]
    when = connection.ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    rows = json.dumps(list(inserts))
    if held:
        sql = f"WITH added AS ({_INSERT.format(run='%s', source='')}) SELECT 1, {_ASYNC}"
        params = [run_id, when, when, rows]
    else:
        # One statement: the UPDATE locks the run row (and finds nothing once it no
        # longer runs); the INSERT feeds on its result, so a stopped run gets nothing.
        insert = _INSERT.format(run="held.id", source="held, ")
        sql = (
            "WITH held AS (UPDATE durable_workflowrun SET updated_at = %s "
            f"WHERE id = %s AND state = %s RETURNING id), added AS ({insert}) "
            f"SELECT (SELECT count(*) FROM held), {_ASYNC}"
        )
        params = [when, run_id, WorkflowState.RUNNING, when, when, rows]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        found, _ = cursor.fetchone()
    return bool(found)


def set_state(
    db: str, run_id: str, state: str, *, wait_signal: str = "", wait_seq: int | None = None
) -> None:
    """Record where a suspended run waits (sleeping, or waiting for a signal/child)."""
    WorkflowRun.objects.using(db).filter(pk=run_id).update(
        state=state, wait_signal=wait_signal, wait_seq=wait_seq
    )


def finish(db: str, run_id: str, state: str, result: Any, error: str, now_ms: int) -> None:
    """Record a run's end: completed with ``result`` or failed with ``error``."""
    WorkflowRun.objects.using(db).filter(pk=run_id).update(
        state=state,
        result=result,
        error=error,
        wait_signal="",
        wait_seq=None,
        finished_at=ms_to_dt(now_ms),
        updated_at=ms_to_dt(now_ms),
    )


def take_signal(db: str, run_id: str, name: str, seq: int, now_ms: int) -> tuple[bool, Any]:
    """Consume the oldest unconsumed signal ``name`` of the run: ``(found, payload)``."""
    signal = (
        WorkflowSignal.objects.using(db)
        .filter(run_id=run_id, name=name, consumed_at__isnull=True)
        .order_by("id")
        .values_list("id", "payload")
        .first()
    )
    if signal is None:
        return False, None
    WorkflowSignal.objects.using(db).filter(pk=signal[0]).update(
        consumed_at=ms_to_dt(now_ms), consumed_seq=seq
    )
    return True, signal[1]


def child_outcome(db: str, run_id: str) -> dict[str, Any] | None:
    """Lock a child run and return ``{state, result, error}``; None if there is none."""
    rows = WorkflowRun.objects.using(db).select_for_update().filter(pk=run_id)
    return rows.values("state", "result", "error").first()
