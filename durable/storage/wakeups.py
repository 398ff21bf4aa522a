"""Queries of the wake-ups that replay inside the firing batch (see workflows/inline.py).

Many runs at a time, in the batch's transaction: read the runs with their histories in
one statement, then write what their replays ended with in one statement per table.
PostgreSQL gets the one-statement forms; other databases the same effects through the
ORM, a run at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.models import F

from durable.models import WorkflowRun, WorkflowState, WorkflowStep
from durable.storage import firing, statements
from durable.storage.checkpoints import (
    ACTIVE,
    HISTORY_SQL,
    RUN_FIELDS,
    STEP_FIELDS,
    RunSnapshot,
    is_postgres,
    json_value,
    snapshot_of,
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
    with statements.cursor(db) as cursor:
        cursor.execute(sql, [list(run_ids)])
        rows = cursor.fetchall()
    return {
        row[0]: snapshot_of(row[0], row[2:-1], json_value(row[-1]))
        for row in rows
        if row[1] in ACTIVE
    }


def _lock_runs_orm(db: str, run_ids: Sequence[str]) -> dict[str, RunSnapshot]:
    runs = WorkflowRun.objects.using(db).filter(pk__in=run_ids, state__in=ACTIVE)
    found = {row[0]: row[1:] for row in runs.values_list("id", *RUN_FIELDS)}
    steps: dict[str, list[dict[str, Any]]] = {run_id: [] for run_id in found}
    rows = WorkflowStep.objects.using(db).filter(run_id__in=found).order_by("run_id", "seq")
    for step in rows.values("run_id", *STEP_FIELDS):
        steps[step.pop("run_id")].append(step)
    return {run_id: snapshot_of(run_id, fields, steps[run_id]) for run_id, fields in found.items()}


def write_ends(db: str, ends: Sequence[RunEnd], now_ms: int) -> None:
    """Write the step records and run states of ``ends`` (runs locked by :func:`lock_runs`).

    On PostgreSQL one statement for the whole batch: new records, changed records and
    the runs. Elsewhere, through the ORM.
    """
    if not ends:
        return
    if is_postgres(db):
        _write_ends_sql(db, ends, ms_to_dt(now_ms))
        return
    when = ms_to_dt(now_ms)
    WorkflowStep.objects.using(db).bulk_create(
        WorkflowStep(run_id=end.run_id, created_at=when, updated_at=when, **step)
        for end in ends
        for step in end.inserts
    )
    for end in ends:
        for step in end.updates:
            values = {k: v for k, v in step.items() if k != "seq"}
            WorkflowStep.objects.using(db).filter(run_id=end.run_id, seq=step["seq"]).update(
                **values, updated_at=when
            )
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


_STEP_COLUMNS = (
    "run_id text, seq integer, kind text, name text, status text, result jsonb, "
    "error text, attempts integer, wake_ms bigint"
)
# The rows travel as JSON parameters: a statement with thousands of placeholders costs
# the client more to build than the server to run. The ANY() conditions give the planner
# an index path whatever it guesses of the JSON's size (with stale statistics it
# hash-joined whole tables).
_WRITE_ENDS = (
    "WITH runs AS (UPDATE durable_workflowrun r SET state = v.state, result = v.result, "
    "error = v.error, wait_signal = '', wait_seq = NULL, replays = r.replays + 1, "
    "updated_at = %(when)s, "
    "finished_at = CASE WHEN v.state = %(sleeping)s THEN r.finished_at ELSE %(when)s END "
    "FROM jsonb_to_recordset(%(runs)s::jsonb) AS v(id text, state text, result jsonb, "
    "error text) WHERE r.id = ANY(%(ids)s) AND r.id = v.id RETURNING 1), "
    "changed AS (UPDATE durable_workflowstep s SET status = u.status, result = u.result, "
    "error = u.error, attempts = u.attempts, wake_ms = u.wake_ms, updated_at = %(when)s "
    f"FROM jsonb_to_recordset(%(updates)s::jsonb) AS u({_STEP_COLUMNS}) "
    "WHERE s.run_id = ANY(%(ids)s) AND s.run_id = u.run_id AND s.seq = u.seq RETURNING 1), "
    "added AS (INSERT INTO durable_workflowstep (run_id, seq, kind, name, status, result, "
    "error, attempts, wake_ms, created_at, updated_at) SELECT i.*, %(when)s, %(when)s "
    f"FROM jsonb_to_recordset(%(inserts)s::jsonb) AS i({_STEP_COLUMNS}) RETURNING 1) "
    "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM changed), "
    "(SELECT count(*) FROM added)"
)


def _write_ends_sql(db: str, ends: Sequence[RunEnd], when: Any) -> None:
    params = {
        "when": when,
        "sleeping": WorkflowState.SLEEPING,
        "ids": [end.run_id for end in ends],
        "runs": json.dumps(
            [{"id": e.run_id, "state": e.state, "result": e.result, "error": e.error} for e in ends]
        ),
        "updates": json.dumps([{"run_id": e.run_id, **s} for e in ends for s in e.updates]),
        "inserts": json.dumps([{"run_id": e.run_id, **s} for e in ends for s in e.inserts]),
    }
    with statements.cursor(db) as cursor:
        cursor.execute(_WRITE_ENDS, params)


def mark_running(
    db: str,
    run_ids: Sequence[str],
    now_ms: int,
    claim: Sequence[int] = (),
    claim_until_ms: int = 0,
    tokens: Mapping[int, int] | None = None,
    *,
    lazy: bool = False,
) -> set[int]:
    """Mark runs locked by :func:`lock_runs` running, as a replay's start does
    (:func:`~durable.storage.checkpoints.begin`): their replay goes to the executor.

    On PostgreSQL, the same statement claims the timers ``claim`` until
    ``claim_until_ms`` under the lease ``tokens`` (:func:`~durable.storage.firing.claim`;
    asynchronously committed if ``lazy``), and the claimed ids are returned; elsewhere
    nothing is claimed.
    """
    if not run_ids:
        return set()
    when = connections[db].ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    update = "UPDATE durable_workflowrun SET state = %s, replays = replays + 1, updated_at = %s"
    params: list[Any] = [WorkflowState.RUNNING, when]
    if not is_postgres(db):
        marks = ", ".join(["%s"] * len(run_ids))
        with statements.cursor(db) as cursor:
            cursor.execute(f"{update} WHERE id IN ({marks})", [*params, *run_ids])
        return set()
    if not claim:
        with statements.cursor(db) as cursor:
            cursor.execute(f"{update} WHERE id = ANY(%s)", [*params, list(run_ids)])
        return set()
    claim_update, claim_params = firing.claim_sql("postgresql", claim, tokens or {}, claim_until_ms)
    sql = (
        f"WITH runs AS ({update} WHERE id = ANY(%s) RETURNING 1), "
        f"claimed AS ({claim_update} RETURNING id) "
        "SELECT (SELECT count(*) FROM runs), array(SELECT id FROM claimed)"
        f"{', ' + firing.LAZY_COMMIT if lazy else ''}"
    )
    with statements.cursor(db) as cursor:
        cursor.execute(sql, [*params, list(run_ids), *claim_params])
        claimed = cursor.fetchone()[1]
    return set(claimed)
