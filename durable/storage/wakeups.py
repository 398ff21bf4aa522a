"""Queries of the wake-ups that replay inside the firing batch (see workflows/inline.py).

Many runs at a time, in the batch's transaction: read the runs with their histories in
one statement, then write what their replays ended with in one statement per table.
PostgreSQL gets the one-statement forms; other databases the same effects through the
ORM, a run at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models import F

from durable.models import WorkflowRun, WorkflowState, WorkflowStep
from durable.storage.checkpoints import (
    ACTIVE,
    HISTORY_SQL,
    RUN_FIELDS,
    STEP_FIELDS,
    RunSnapshot,
    is_postgres,
)
from durable.storage.leases import ms_to_dt


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEnd:
    """Where one inline replay left its run: the records it wrote and the run's new state."""

    run_id: str
    state: str
    """``completed``, ``failed``, or ``sleeping`` (suspended until a timer)."""
    inserts: list[dict[str, Any]]
    """New step records (``STEP_FIELDS`` each)."""
    updates: list[dict[str, Any]]
    """Changed step records (a sleep settled), ``STEP_FIELDS`` each."""
    result: Any = None
    error: str = ""


def lock_runs(db: str, run_ids: Sequence[str]) -> dict[str, RunSnapshot]:
    """Lock the unfinished runs among ``run_ids`` and read them with their histories.

    A run locked by another transaction right now (a cancel, a signal, a checkpoint of a
    replay on the executor) is skipped, not waited for: its wake-up goes the usual way.
    """
    if not run_ids:
        return {}
    if not is_postgres(db):
        return _lock_runs_orm(db, run_ids)
    # The state is checked here rather than in SQL: a filter on it invites the planner
    # to use the state index (with stale statistics, a scan of every active run).
    sql = (
        f"SELECT id, state, {', '.join(RUN_FIELDS)}, {HISTORY_SQL} FROM durable_workflowrun "
        "WHERE id = ANY(%s) ORDER BY id FOR UPDATE SKIP LOCKED"
    )
    with connections[db].cursor() as cursor:
        cursor.execute(sql, [list(run_ids)])
        rows = cursor.fetchall()
    return {
        row[0]: _snapshot(row[0], row[2:-1], _json(row[-1])) for row in rows if row[1] in ACTIVE
    }


def _lock_runs_orm(db: str, run_ids: Sequence[str]) -> dict[str, RunSnapshot]:
    runs = WorkflowRun.objects.using(db).filter(pk__in=run_ids, state__in=ACTIVE)
    found = {row[0]: row[1:] for row in runs.values_list("id", *RUN_FIELDS)}
    steps: dict[str, list[dict[str, Any]]] = {run_id: [] for run_id in found}
    rows = WorkflowStep.objects.using(db).filter(run_id__in=found).order_by("run_id", "seq")
    for step in rows.values("run_id", *STEP_FIELDS):
        steps[step.pop("run_id")].append(step)
    return {run_id: _snapshot(run_id, fields, steps[run_id]) for run_id, fields in found.items()}


def _snapshot(run_id: str, fields: Sequence[Any], steps: list[dict[str, Any]]) -> RunSnapshot:
    name, shard, args, kwargs, model_label, object_pk, parent_id = fields
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


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def write_ends(db: str, ends: Sequence[RunEnd], now_ms: int) -> None:
    """Write the step records and run states of ``ends`` (runs locked by :func:`lock_runs`)."""
    if not ends:
        return
    when = ms_to_dt(now_ms)
    inserts = [
        WorkflowStep(run_id=end.run_id, created_at=when, updated_at=when, **step)
        for end in ends
        for step in end.inserts
    ]
    WorkflowStep.objects.using(db).bulk_create(inserts)
    updates = [(end.run_id, step) for end in ends for step in end.updates]
    if is_postgres(db):
        _update_steps_sql(db, updates, when)
        _update_runs_sql(db, ends, when)
        return
    for run_id, step in updates:
        values = {k: v for k, v in step.items() if k != "seq"}
        WorkflowStep.objects.using(db).filter(run_id=run_id, seq=step["seq"]).update(
            **values, updated_at=when
        )
    for end in ends:
        finished = end.state != WorkflowState.SLEEPING
        WorkflowRun.objects.using(db).filter(pk=end.run_id).update(
            state=end.state,
            result=end.result,
            error=end.error,
            wait_signal="",
            wait_seq=None,
            replays=F("replays") + 1,
            updated_at=when,
            **({"finished_at": when} if finished else {}),
        )


def _update_steps_sql(db: str, updates: Sequence[tuple[str, dict[str, Any]]], when: Any) -> None:
    # The rows travel as one JSON parameter: a statement with thousands of placeholders
    # costs the client more to build than the server to run. The ANY() condition gives
    # the planner an index path whatever it guesses of the JSON's size (with stale
    # statistics it hash-joined the whole table).
    if not updates:
        return
    rows = json.dumps([{"run_id": run_id, **step} for run_id, step in updates])
    sql = (
        "UPDATE durable_workflowstep s SET status = v.status, result = v.result, "
        "error = v.error, attempts = v.attempts, wake_ms = v.wake_ms, updated_at = %s "
        "FROM jsonb_to_recordset(%s::jsonb) AS v(run_id text, seq integer, status text, "
        "result jsonb, error text, attempts integer, wake_ms bigint) "
        "WHERE s.run_id = ANY(%s) AND s.run_id = v.run_id AND s.seq = v.seq"
    )
    with connections[db].cursor() as cursor:
        cursor.execute(sql, [when, rows, sorted({run_id for run_id, _ in updates})])


def _update_runs_sql(db: str, ends: Sequence[RunEnd], when: Any) -> None:
    rows = json.dumps(
        [{"id": e.run_id, "state": e.state, "result": e.result, "error": e.error} for e in ends]
    )
    sql = (
        "UPDATE durable_workflowrun r SET state = v.state, result = v.result, "
        "error = v.error, wait_signal = '', wait_seq = NULL, replays = r.replays + 1, "
        "updated_at = %s, finished_at = CASE WHEN v.state = %s THEN r.finished_at ELSE %s END "
        "FROM jsonb_to_recordset(%s::jsonb) AS v(id text, state text, result jsonb, error text) "
        "WHERE r.id = ANY(%s) AND r.id = v.id"
    )
    ids = [end.run_id for end in ends]
    with connections[db].cursor() as cursor:
        cursor.execute(sql, [when, WorkflowState.SLEEPING, when, rows, ids])


def mark_running(db: str, run_ids: Sequence[str], now_ms: int) -> None:
    """Mark runs locked by :func:`lock_runs` running, as a replay's start does
    (:func:`~durable.storage.checkpoints.begin`): their replay goes to the executor."""
    if run_ids:
        WorkflowRun.objects.using(db).filter(pk__in=run_ids).update(
            state=WorkflowState.RUNNING, replays=F("replays") + 1, updated_at=ms_to_dt(now_ms)
        )
