"""Starting runs: one, or many with one INSERT, in the caller's transaction.

A start writes the ``WorkflowRun`` row and its first wake-up timer (``wf:<id>:start``,
due now, on the run's shard) on ``DURABLE["DATABASE"]`` inside the caller's
transaction: a start in a transaction that rolls back leaves nothing behind and never
runs. Everything is validated before the first write.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import transaction

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.models import WorkflowRun
from durable.storage import workflows as store
from durable.workflows.planning import plan_fields
from durable.workflows.registry import WorkflowDef
from durable.workflows.slots import run_shard

CALL_KEYS = frozenset({"args", "kwargs", "run_id", "instance"})


def start_run(
    definition: WorkflowDef,
    instance: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    run_id: str | None,
) -> WorkflowRun:
    """Validate, then write the run and its start timer; an existing ``run_id`` is returned."""
    conf = get_settings()
    fields = plan_fields(definition, instance, args, kwargs, run_id)
    key = fields["concurrency_key"]
    run = store.new_run(fields, run_shard(fields["id"], key, conf.SHARDS))
    now_ms = current_clock().now_ms()
    db = conf.DATABASE
    start_key = store.wake_key(run.pk, "start")
    if run_id is None and store.can_start_in_one_statement(db):
        # A fresh uuid4: nothing to collide with, nothing to look up.
        timer = store.wake_timer(run.pk, run.shard, start_key, now_ms, key)
        store.insert_started(db, run, timer)
        return run
    with transaction.atomic(using=db, savepoint=False):
        if run_id is None:
            run.save(using=db, force_insert=True)
            created = True
        else:
            run, created = store.insert_run(db, run)
        if created:
            store.ensure_wake(db, run.pk, run.shard, start_key, now_ms, now_ms, key)
    return run


def start_many(definition: WorkflowDef, calls: Iterable[dict[str, Any]]) -> list[WorkflowRun]:
    """Start many runs: one INSERT for the runs, one for their timers; input order kept."""
    conf = get_settings()
    planned: list[WorkflowRun] = []
    explicit: dict[str, int] = {}
    for index, call in enumerate(calls):
        where = f"calls[{index}]"
        if not isinstance(call, dict) or not CALL_KEYS.issuperset(call):
            raise TypeError(f"{where}: expected a dict with keys among {sorted(CALL_KEYS)}")
        fields = plan_fields(
            definition,
            call.get("instance"),
            call.get("args", ()),
            call.get("kwargs"),
            call.get("run_id"),
            where,
        )
        if call.get("run_id") is not None:
            if fields["id"] in explicit:
                raise ValueError(
                    f"{where}.run_id: {fields['id']!r} repeats calls[{explicit[fields['id']]}]"
                )
            explicit[fields["id"]] = index
        shard = run_shard(fields["id"], fields["concurrency_key"], conf.SHARDS)
        planned.append(store.new_run(fields, shard))
    now_ms = current_clock().now_ms()
    db = conf.DATABASE
    with transaction.atomic(using=db, savepoint=False):
        existing = store.runs_by_ids(db, explicit) if explicit else {}
        new = [run for run in planned if run.pk not in existing]
        inserted = store.insert_runs(db, new) if new else {}
        wakes = [
            store.wake_timer(
                run.pk, run.shard, store.wake_key(run.pk, "start"), now_ms, run.concurrency_key
            )
            for run in new
        ]
        store.schedule_wakes(db, wakes, now_ms)
    return [existing.get(run.pk) or inserted[run.pk] for run in planned]
