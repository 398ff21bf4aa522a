"""What holds a concurrency key's slots, and who waits in its line: one statement per decision.

Per key, :func:`counts` reads the *active* (holding a slot), the woken timers not started
yet (they hold theirs until they do), and whether any timer is parked. Active is, for a
handler's key, its timers in state ``firing``; for a workflow's key
(:mod:`durable.workflows.slots`), its runs that are running, sleeping or waiting, plus
its start timers claimed (``firing``) whose run has not begun its replay yet (still
``pending``: a worker died in between, say). A run's start timer and the run itself are
never both counted. Every part reads its own index range (``durable_timer_conc_idx``,
``durable_timer_line_idx``, ``durable_wfrun_conc_idx``), never a key's other rows.
"""

from __future__ import annotations

from django.db import connections

from durable.models import TimerState
from durable.storage import statements

#: 9999-12-31T23:59:59.999Z: a parked timer's due time ("when a slot frees").
PARKED_MS = 253_402_300_799_999
#: Stored workflow keys start with this (see :mod:`durable.workflows.slots`).
WORKFLOW_PREFIX = "workflow:"
#: The run states that hold a slot of their key.
HOLDING = ("running", "sleeping", "waiting")

_PENDING = TimerState.PENDING.value
_FIRING = TimerState.FIRING.value


def counts(
    db: str, names: list[str], exclude: list[int], *, active: bool = True
) -> dict[str, tuple[int, int, int]]:
    """Per key: (active, woken and not started yet, 1 if any is parked else 0), leaving the
    timers ``exclude`` out. One statement for all keys.

    A key with a million timers due next month costs nothing here. ``active=False``: the
    caller needs no active count (none of the keys has a ``max_concurrency``, only a
    rate): it is given as 0, and not read.
    """
    vendor = connections[db].vendor
    workflow = any(name.startswith(WORKFLOW_PREFIX) for name in names)
    sql, args = counts_sql(vendor, names, exclude, workflow=workflow, active=active)
    with statements.cursor(db) as cursor:
        cursor.execute(sql, args)
        return read(cursor.fetchall())


def read(rows: list[tuple[str, int, int, int]]) -> dict[str, tuple[int, int, int]]:
    """:func:`counts` of the rows of a :func:`counts_sql` statement."""
    return {name: (int(a), int(r), int(w)) for name, a, r, w in rows}


def counts_sql(
    vendor: str,
    names: list[str] | None,
    exclude: list[int],
    *,
    workflow: bool,
    keys_of: list[int] | None = None,
    active: bool = True,
) -> tuple[str, list[object]]:
    """The statement of :func:`counts`, and its parameters.

    ``names`` ``None`` (PostgreSQL only): the keys of the timers ``keys_of`` (by default
    ``exclude``), read by the statement itself, so that it can be sent before the caller
    knows them (pipelined behind the statement that locks them). ``workflow``: some key
    may be a workflow's (``workflow:`` prefix): the runs of such keys are counted too
    (the statement tells the keys apart by name). ``active``: as :func:`counts`'
    (``False``: given as 0).
    """
    where, params = statements.in_clause(vendor, exclude or [0])
    mine = f"FROM durable_timer t WHERE t.concurrency_key = k.name AND NOT (t.{where})"
    line = f"{mine} AND t.state = %s AND t.queued_ms IS NOT NULL"
    firing = f"(SELECT count(*) {mine} AND t.state = %s)"
    firing_args = [*params, _FIRING]
    if not active:
        firing, firing_args = "0", []
    elif workflow:
        holding = ", ".join(["%s"] * len(HOLDING))
        runs = (
            "FROM durable_workflowrun r WHERE r.concurrency_key = k.name "
            f"AND r.state IN ({holding})"
        )
        # Per key by its name: a handler's key has no runs, so the pipelined count (sent
        # before the keys are known) costs a handler's key no reads of the runs.
        firing = (
            f"(CASE WHEN k.name LIKE %s THEN (SELECT count(*) {mine} AND t.state = %s "
            f"AND NOT EXISTS (SELECT 1 {runs} AND r.id = t.target)) + "
            f"(SELECT count(*) {runs}) ELSE {firing} END)"
        )
        firing_args = [
            f"{WORKFLOW_PREFIX}%",
            *(*params, _FIRING, *HOLDING, *HOLDING),
            *firing_args,
        ]
    parts = (
        f"{firing}, "
        f"(SELECT count(*) {line} AND t.fire_at_ms < %s), "
        f"(SELECT count(*) FROM (SELECT 1 {line} AND t.fire_at_ms = %s LIMIT 1) AS parked)"
    )
    args = [
        *firing_args,
        *(*params, _PENDING, PARKED_MS),
        *(*params, _PENDING, PARKED_MS),
    ]
    if names is None:
        of, of_params = statements.in_clause(vendor, exclude if keys_of is None else keys_of)
        sql = (
            f"SELECT k.name, {parts} FROM (SELECT DISTINCT concurrency_key AS name "
            f"FROM durable_timer WHERE {of} AND concurrency_key IS NOT NULL) AS k"
        )
        args.extend(of_params)
    elif vendor == "postgresql":
        sql = f"SELECT k.name, {parts} FROM unnest(%s::text[]) AS k(name)"
        args.append(names)
    else:
        keys = " UNION ALL ".join(["SELECT %s AS name"] * len(names))
        sql = f"SELECT k.name, {parts} FROM ({keys}) AS k"
        args.extend(names)
    return sql, args


def in_ancestors_slot(db: str, name: str, timer_ids: list[int]) -> set[int]:
    """Of the start timers ``timer_ids`` of key ``name``, those whose run has an ancestor
    (its parent, or further up, through runs of any workflow) holding a slot of ``name``.

    Such a run is admitted in its ancestor's slot (see
    :func:`durable.storage.concurrency.admit`): the ancestor holds the slot until its end,
    and one that waits for this run would otherwise wait for ever. One statement; the
    runs are read, not locked: an ancestor's end waits for the key's row this
    transaction holds before it frees the slot (:func:`~durable.storage.run_slots.release_runs`).
    """
    if not timer_ids:
        return set()
    where, params = statements.in_clause(connections[db].vendor, timer_ids)
    holding = ", ".join(["%s"] * len(HOLDING))
    with statements.cursor(db) as cursor:
        cursor.execute(
            "WITH RECURSIVE up(timer_id, run_id) AS ("
            "SELECT t.id, r.parent_id FROM durable_timer t JOIN durable_workflowrun r "
            f"ON r.id = t.target WHERE t.{where} AND r.parent_id IS NOT NULL "
            "UNION ALL SELECT up.timer_id, r.parent_id FROM up JOIN durable_workflowrun r "
            "ON r.id = up.run_id WHERE r.parent_id IS NOT NULL) "
            "SELECT DISTINCT up.timer_id FROM up JOIN durable_workflowrun a ON a.id = up.run_id "
            f"WHERE a.concurrency_key = %s AND a.state IN ({holding})",
            [*params, name, *HOLDING],
        )
        return {int(row[0]) for row in cursor.fetchall()}
