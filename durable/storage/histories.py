"""Read-only reads of unfinished runs with their histories, a page at a time.

For ``manage.py durable_check_runs``, which replays every unfinished run against the
code installed now: it must change nothing, so nothing here locks or writes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from django.apps import apps
from django.db import connections, transaction

from durable.models import WorkflowRun, WorkflowStep
from durable.storage.checkpoints import (
    ACTIVE,
    RUN_FIELDS,
    STEP_FIELDS,
    RunSnapshot,
    is_postgres,
    json_value,
    snapshot_of,
)

# Each run's history as one JSON array of arrays (STEP_FIELDS order): a third of the
# server's time of checkpoint_sql.HISTORY_SQL's array of objects, which names every field
# of every step (measured on 1,000 runs of 7 steps: 27 ms against 67-109 ms).
HISTORY_ARRAYS_SQL = (
    "(SELECT coalesce(json_agg(json_build_array(s.seq, s.kind, s.name, s.status, s.result, "
    "s.error, s.attempts, s.wake_ms) ORDER BY s.seq), '[]') FROM durable_workflowstep s "
    "WHERE s.run_id = durable_workflowrun.id)"
)


def unfinished_runs(
    db: str, names: Sequence[str] = (), page: int = 1000
) -> Iterator[list[tuple[str, RunSnapshot]]]:
    """Every unfinished run with its history, as lists of up to ``page``
    ``(state, snapshot)``; only the workflows ``names`` if given.

    On PostgreSQL one statement read through a server-side cursor, in a read-only
    transaction of its own: one scan of the runs however many there are (pages of
    ``id > last ORDER BY id`` would let the planner sort every active run again for
    each page). Elsewhere, pages by primary key.
    """
    if is_postgres(db):
        yield from _scan_sql(db, names, page)
        return
    after = ""
    while batch := _page_orm(db, after, page, names):
        yield batch
        after = batch[-1][1].id


def _page_orm(
    db: str, after: str, limit: int, names: Sequence[str]
) -> list[tuple[str, RunSnapshot]]:
    runs = WorkflowRun.objects.using(db).filter(state__in=ACTIVE, pk__gt=after)
    if names:
        runs = runs.filter(name__in=list(names))
    found = list(runs.order_by("pk").values_list("id", "state", *RUN_FIELDS)[:limit])
    steps: dict[str, list[dict[str, Any]]] = {row[0]: [] for row in found}
    rows = WorkflowStep.objects.using(db).filter(run_id__in=list(steps)).order_by("run_id", "seq")
    for step in rows.values("run_id", *STEP_FIELDS):
        steps[step.pop("run_id")].append(step)
    return [(row[1], snapshot_of(row[0], row[2:], steps[row[0]])) for row in found]


def _scan_sql(db: str, names: Sequence[str], page: int) -> Iterator[list[tuple[str, RunSnapshot]]]:
    where = "state = ANY(%s)"
    params: list[Any] = [list(ACTIVE)]
    if names:
        where += " AND name = ANY(%s)"
        params.append(list(names))
    sql = (
        f"SELECT id, state, {', '.join(RUN_FIELDS)}, {HISTORY_ARRAYS_SQL} "
        f"FROM durable_workflowrun WHERE {where}"
    )
    # Inside a transaction the cursor needs no WITH HOLD, so rows are computed as they
    # are fetched rather than all at once when it is declared.
    with transaction.atomic(using=db), connections[db].chunked_cursor() as cursor:
        cursor.execute(sql, params)
        while rows := cursor.fetchmany(page):
            batch = []
            for row in rows:
                steps = [dict(zip(STEP_FIELDS, step, strict=True)) for step in json_value(row[-1])]
                batch.append((row[1], snapshot_of(row[0], row[2:-1], steps)))
            yield batch


def bound_rows(db: str, label: str, pks: Sequence[str]) -> dict[str, Any] | None:
    """The rows of model ``label`` with primary keys ``pks`` (as strings), by pk string;
    None if the model no longer exists."""
    try:
        model = apps.get_model(label)
    except (LookupError, ValueError):
        return None
    field = model._meta.pk
    wanted = [field.to_python(pk) for pk in pks]
    found = model._base_manager.using(db).in_bulk(wanted)
    return {str(pk): row for pk, row in found.items()}
