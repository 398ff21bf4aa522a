"""Queries of a replay's checkpoints: start the replay, record steps, suspend, finish.

The SQL text of the one-statement paths is :mod:`durable.storage.checkpoint_sql`.

Each checkpoint is a short transaction the replay opens itself (and fences). The hot path
(one step = one checkpoint) is shaped for round trips: on PostgreSQL, locking the run,
checking it still runs and inserting the step records is one statement, and so is
starting a replay. Other databases get the same effects through the ORM.

Checkpoint transactions commit synchronously by default, as every commit durable makes
that reports something done. ``DURABLE["ASYNC_COMMIT"] = True`` lets them commit
asynchronously on PostgreSQL (``synchronous_commit`` off, for that transaction only): a
step then costs round trips, not a disk flush. The run still cannot lose a step for good:
the wake-up timer that started the replay stays claimed until it is marked fired in a
synchronous commit, which flushes the WAL up to itself, checkpoints included; if the
database crashes before that, the replay runs again from what was flushed (a worker crash
loses nothing, the server has every commit). What it risks: until the flush, other
connections can read what a ``ctx.atomic`` step wrote, and a database crash then takes it
back until the replay does the step again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections

from durable.models import WorkflowRun, WorkflowSignal, WorkflowState, WorkflowStep
from durable.storage import statements

# The statements themselves; HISTORY_SQL, commit_mode and jsonb stay importable here.
from durable.storage.checkpoint_sql import (
    HISTORY_SQL,
    added_cte,
    commit_mode,
    jsonb,
    run_statement,
    started_at,
)
from durable.storage.leases import ms_to_dt

STEP_FIELDS = ("seq", "kind", "name", "status", "result", "error", "attempts", "wake_ms")
ACTIVE = WorkflowRun.ACTIVE_STATES
RUN_FIELDS = (
    "name", "shard", "args", "kwargs", "model_label", "object_pk", "parent_id", "concurrency_key"
)  # fmt: skip


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
    concurrency_key: str | None = None
    """Its workflow's key: it holds a slot of it (:mod:`durable.workflows.slots`)."""


def is_postgres(db: str) -> bool:
    """True when ``db`` is PostgreSQL (the checkpoints' one-statement paths)."""
    return connections[db].vendor == "postgresql"


def json_value(value: Any) -> Any:
    """A JSON column as read: parsed if the driver handed over text (SQLite), else as is."""
    return json.loads(value) if isinstance(value, str | bytes) else value


def begin(db: str, run_id: str, now_ms: int) -> RunSnapshot | None:
    """Mark an unfinished run running and read it with its history; None if finished.

    On PostgreSQL one statement: the history comes back in the same row, as JSON.
    """
    connection = connections[db]
    extra = f", {HISTORY_SQL}, {commit_mode()}" if is_postgres(db) else ""
    placeholders = ", ".join(["%s"] * len(ACTIVE))
    sql = (
        "UPDATE durable_workflowrun SET state = %s, replays = replays + 1, updated_at = %s "
        f"WHERE id = %s AND state IN ({placeholders}) RETURNING {', '.join(RUN_FIELDS)}{extra}"
    )
    when = connection.ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    with statements.cursor(db) as cursor:
        cursor.execute(sql, [WorkflowState.RUNNING, when, run_id, *ACTIVE])
        row = cursor.fetchone()
    if row is None:
        return None
    if extra:
        steps = json_value(row[len(RUN_FIELDS)])
    else:
        rows = WorkflowStep.objects.using(db).filter(run_id=run_id).order_by("seq")
        steps = list(rows.values(*STEP_FIELDS))
    return snapshot_of(run_id, row[: len(RUN_FIELDS)], steps)


def snapshot_of(run_id: str, fields: Sequence[Any], steps: list[dict[str, Any]]) -> RunSnapshot:
    """A :class:`RunSnapshot` from the run's ``RUN_FIELDS`` values, as read, and its steps."""
    name, shard, args, kwargs, model_label, object_pk, parent_id, key = fields
    return RunSnapshot(
        id=run_id,
        name=name,
        shard=shard,
        args=json_value(args),
        kwargs=json_value(kwargs),
        model_label=model_label,
        object_pk=object_pk,
        parent_id=parent_id,
        steps=steps,
        concurrency_key=key,
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
        # A step's later attempt keeps the first attempt's start: the row's started_at
        # is when the step began; its duration is the latest attempt's.
        values = _columns(step)
        values.pop("started_at", None)
        WorkflowStep.objects.using(db).filter(run_id=run_id, seq=step["seq"]).update(
            **values, updated_at=when
        )
    if not is_postgres(db):
        if not held and not hold(db, run_id, now_ms):
            return False
        WorkflowStep.objects.using(db).bulk_create(
            [
                WorkflowStep(run_id=run_id, seq=s["seq"], created_at=when, updated_at=when,
                             **_columns(s))
                for s in inserts
            ]
        )  # fmt: skip
        return True
    return _insert(db, run_id, inserts, now_ms, held=held)


def _columns(step: dict[str, Any]) -> dict[str, Any]:
    """A step record's row (``Record.row()``) as the model's column values but ``seq``:
    the attempt's ``started_ms`` becomes the ``started_at`` datetime."""
    values = {k: v for k, v in step.items() if k not in ("seq", "started_ms")}
    if "started_ms" in step:
        values["started_at"] = started_at(step)
    return values


def _insert(
    db: str, run_id: str, inserts: Sequence[dict[str, Any]], now_ms: int, *, held: bool
) -> bool:
    when = connections[db].ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    if not held:
        # One statement: the UPDATE locks the run row (and finds nothing once it no
        # longer runs); the INSERT feeds on its result, so a stopped run gets nothing.
        # The caller's transaction is fenced already.
        found, _ = run_statement(db, run_id, None, "updated_at = %s", [when], inserts, when)
        return found
    added, params = added_cte("%s", "", inserts, when)
    sql = f"WITH {added or 'nothing AS (SELECT 1)'} SELECT 1, {commit_mode()}"
    with statements.cursor(db) as cursor:
        cursor.execute(sql, [run_id, *params] if inserts else [])
    return True


def record_steps(
    db: str,
    run_id: str,
    lease: tuple[int, int] | None,
    inserts: Sequence[dict[str, Any]],
    now_ms: int,
) -> bool:
    """Insert step records in one statement of their own (PostgreSQL only).

    The fast checkpoint of an outside step: outside ``transaction.atomic`` the statement
    is its own transaction, so fencing the shard (a share lock on its lease row, as
    :func:`~durable.storage.leases.fence` takes), locking the run, checking that it still
    runs, inserting and committing cost one round trip instead of four. Returns False
    (writing nothing) when the run no longer runs; raises
    :class:`~durable.exceptions.LeaseLost` when ``lease`` (shard, token) is stale.
    """
    when = connections[db].ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    found, _ = run_statement(db, run_id, lease, "updated_at = %s", [when], inserts, when)
    return found


@dataclass(frozen=True, slots=True)
class Claim:
    """The claimed wake-up timer a replay may mark fired in its last statement."""

    timer_id: int
    attempts: int
    token: int


def finish_run(
    db: str,
    run_id: str,
    lease: tuple[int, int] | None,
    end: tuple[str, Any, str],
    inserts: Sequence[dict[str, Any]],
    claim: Claim | None,
    now_ms: int,
) -> tuple[bool, bool]:
    """End a run in one statement of its own (PostgreSQL only), synchronously committed.

    ``end`` is (state, result, error). Fences like :func:`record_steps`, writes the
    pending step records, and marks the claimed wake-up timer fired (see
    :func:`durable.storage.firing.complete_claim`). Returns (ended, timer marked); ended
    False means the run no longer runs and nothing was written.
    """
    when = connections[db].ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    state, result, error = end
    set_sql = (
        "state = %s, result = %s::jsonb, error = %s, wait_signal = '', wait_seq = NULL, "
        "finished_at = %s, updated_at = %s"
    )
    fired_cte, fired_params = "", []
    if claim is not None:
        fired_cte = (
            ", fired AS (UPDATE durable_timer SET state = 'fired', fired_token = %s, "
            "fired_at = %s, updated_at = %s, claim_expires_ms = NULL, claim_token = NULL, "
            "last_error = '' WHERE id = %s AND state = 'firing' AND attempts = %s "
            "AND EXISTS (SELECT 1 FROM held) RETURNING id)"
        )
        fired_params = [claim.token, when, when, claim.timer_id, claim.attempts]
    ended, fired = run_statement(
        db,
        run_id,
        lease,
        set_sql,
        [state, jsonb(result), error, when, when],
        inserts,
        when,
        tail=(fired_cte, fired_params, ", (SELECT count(*) FROM fired)" if claim else ", 0"),
        commit="",
    )
    return ended, bool(fired)


def set_state(
    db: str, run_id: str, state: str, *, wait_signal: str = "", wait_seq: int | None = None
) -> None:
    """Record where a suspended run waits (sleeping, or waiting for a signal/child)."""
    WorkflowRun.objects.using(db).filter(pk=run_id).update(
        state=state, wait_signal=wait_signal, wait_seq=wait_seq
    )


def fail_unfinished(db: str, run_id: str, error: str, now_ms: int) -> str | None:
    """Fail run ``run_id`` with ``error`` unless it has ended; return its parent id ("" if
    none), or None when it had ended already."""
    when = ms_to_dt(now_ms)
    rows = WorkflowRun.objects.using(db).filter(pk=run_id, state__in=ACTIVE)
    parent = rows.values_list("parent_id", flat=True).first()
    updated = rows.update(
        state=WorkflowState.FAILED, error=error, wait_signal="", wait_seq=None,
        finished_at=when, updated_at=when,
    )  # fmt: skip
    return (parent or "") if updated else None


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
