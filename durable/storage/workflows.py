"""Queries of workflows: runs, their recorded steps, signals and wake-up timers.

Everything runs on the alias it is given, inside the caller's transaction; nothing here
commits on its own. Starting a run and sending a signal are writes in the application's
transaction; the replay's checkpoints are transactions the replay opens (and fences)
itself (their queries are in :mod:`durable.storage.checkpoints`). Steps travel as plain
dicts of ``WorkflowStep`` fields, so this layer knows nothing of the replay's types.

Wake-up timers are ordinary ``Timer`` rows of kind ``workflow`` whose target is the run
id, on the run's shard, with keys ``wf:<run id>:...``: the key's unique index makes a
duplicate wake-up collapse into the existing one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models import F
from django.db.models.sql import InsertQuery

from durable.conf import get_settings
from durable.core.sharding import bucket_of, shard_for
from durable.models import (
    Timer,
    TimerKind,
    TimerState,
    WorkflowRun,
    WorkflowSignal,
    WorkflowState,
    WorkflowStep,
)
from durable.storage import run_slots, statements
from durable.storage.checkpoints import STEP_FIELDS
from durable.storage.leases import ms_to_dt
from durable.storage.notify import CHANNEL, collecting_now
from durable.storage.timers import announce, by_keys, insert_many, insert_timer, new_timer

ACTIVE = WorkflowRun.ACTIVE_STATES
# A wake-up fails only when durable itself does (workflow errors fail the run, not the
# timer), so it retries for hours rather than dead-lettering and stranding the run.
WAKE_MAX_ATTEMPTS = 25
_CHUNK = 500


# -- runs and their wake-ups -----------------------------------------------------------


def new_run(fields: dict[str, Any], shard: int, parent_id: str | None = None) -> WorkflowRun:
    """An unsaved ``WorkflowRun`` from validated start fields."""
    return WorkflowRun(shard=shard, parent_id=parent_id, state=WorkflowState.PENDING, **fields)


def insert_run(db: str, run: WorkflowRun) -> tuple[WorkflowRun, bool]:
    """Insert ``run``; if its id exists, return that run instead (``created`` False).

    On PostgreSQL a concurrent insert of the same id waits on the primary key for the
    first transaction's outcome, then lands here and returns the committed row.
    """
    existing = WorkflowRun.objects.using(db).filter(pk=run.pk).first()
    if existing is not None:
        return existing, False
    try:
        with transaction.atomic(using=db):
            run.save(using=db, force_insert=True)
    except IntegrityError:
        existing = WorkflowRun.objects.using(db).filter(pk=run.pk).first()
        if existing is None:
            raise
        return existing, False
    return run, True


def can_start_in_one_statement(db: str) -> bool:
    """Whether :func:`insert_started` applies: PostgreSQL, and not inside a firing batch
    (whose timers are announced by collecting them, not by NOTIFY)."""
    return connections[db].vendor == "postgresql" and not collecting_now()


def insert_started(db: str, run: WorkflowRun, timer: Timer) -> None:
    """Insert a new run (an id nobody can have used) and its start timer, and NOTIFY the
    timer, in one statement (see :func:`can_start_in_one_statement`).

    Outside a transaction the statement is its own: ``start()`` then costs one round
    trip instead of five (BEGIN, two inserts, the NOTIFY, COMMIT). The inserts are
    Django's own (``InsertQuery``), so columns, defaults and clock stamps stay the ORM's.
    """
    run_sql, run_params = _insert_sql(db, WorkflowRun, run, with_pk=True)
    timer_sql, timer_params = _insert_sql(db, Timer, timer, with_pk=False)
    notify = ", pg_notify(%s, t.shard || ',' || t.id || ',' || t.fire_at_ms)"
    announce_it = get_settings().NOTIFY
    sql = (
        f"WITH r AS ({run_sql} RETURNING 1), "
        f"t AS ({timer_sql} RETURNING id, shard, fire_at_ms) "
        f"SELECT t.id{notify if announce_it else ''} FROM t"  # r runs whether read or not
    )
    params = [*run_params, *timer_params, *([CHANNEL] if announce_it else [])]
    with statements.cursor(db) as cursor:  # preparable: start() is called in loops too
        cursor.execute(sql, params)
        timer.pk = cursor.fetchone()[0]
    for obj in (run, timer):
        obj._state.adding = False
        obj._state.db = db


def _insert_sql(db: str, model: Any, obj: Any, *, with_pk: bool) -> tuple[str, list[Any]]:
    fields = [f for f in model._meta.concrete_fields if with_pk or not f.primary_key]
    query = InsertQuery(model)
    query.insert_values(fields, [obj])
    [(sql, params)] = query.get_compiler(using=db).as_sql()
    return sql, list(params)


def insert_runs(db: str, runs: Sequence[WorkflowRun]) -> dict[str, WorkflowRun]:
    """Insert many runs (ids not seen yet) in one statement; return every run by id.

    If another transaction inserted one of the ids meanwhile, falls back to inserting
    one by one, so each id ends up with exactly one row.
    """
    try:
        with transaction.atomic(using=db):
            WorkflowRun.objects.using(db).bulk_create(runs, batch_size=2000)
        return {run.pk: run for run in runs}
    except IntegrityError:
        return {run.pk: insert_run(db, run)[0] for run in runs}


def runs_by_ids(db: str, ids: Iterable[str]) -> dict[str, WorkflowRun]:
    """The existing runs among ``ids``, by id."""
    found: dict[str, WorkflowRun] = {}
    ids = list(ids)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        found.update((run.pk, run) for run in WorkflowRun.objects.using(db).filter(pk__in=chunk))
    return found


def shard_of(db: str, run_id: str) -> int:
    """The stored shard of run ``run_id`` (a keyed run lives on its key's shard, not its
    id's); its id's shard if there is no such run."""
    shard = WorkflowRun.objects.using(db).filter(pk=run_id).values_list("shard", flat=True)
    found = shard.first()
    return shard_for(run_id, get_settings().SHARDS) if found is None else int(found)


def wake_key(run_id: str, *parts: object) -> str:
    """The idempotency key of a wake-up: ``wf:<run id>:<part>:...``."""
    return ":".join(["wf", run_id, *map(str, parts)])


def wake_timer(
    run_id: str, shard: int, key: str, fire_at_ms: int, concurrency_key: str | None = None
) -> Timer:
    """An unsaved wake-up timer for ``run_id``, due at ``fire_at_ms``.

    ``concurrency_key``: the run's, on the timers that start it (its start, a retry): the
    firer admits them by their key's limits (:mod:`durable.workflows.slots`).
    """
    conf = get_settings()
    return new_timer(
        shard=shard,
        bucket=bucket_of(fire_at_ms, conf.BUCKET_SHIFT),
        fire_at_ms=fire_at_ms,
        state=TimerState.PENDING,
        kind=TimerKind.WORKFLOW,
        target=run_id,
        key=key,
        max_attempts=WAKE_MAX_ATTEMPTS,
        backoff_base_s=conf.BACKOFF_BASE_S,
        backoff_max_s=min(conf.BACKOFF_MAX_S, 300.0),
        concurrency_key=concurrency_key,
    )


def ensure_wake(
    db: str,
    run_id: str,
    shard: int,
    key: str,
    fire_at_ms: int,
    now_ms: int,
    concurrency_key: str | None = None,
) -> None:
    """Make sure a pending wake-up for ``run_id`` exists under ``key`` (announced if new).

    A key whose timer already fired (the run was woken early by something else and must
    wait again) gets a fresh timer under ``<key>:r<n>``.
    """
    timer, created = insert_timer(db, wake_timer(run_id, shard, key, fire_at_ms, concurrency_key))
    suffix = 0
    while not created and timer.state != TimerState.PENDING:
        suffix += 1
        again = wake_timer(run_id, shard, f"{key}:r{suffix}", fire_at_ms, concurrency_key)
        timer, created = insert_timer(db, again)
    if created:
        announce(db, [timer], now_ms)


def schedule_wakes(db: str, timers: Sequence[Timer], now_ms: int) -> None:
    """Insert new wake-up timers in one statement (keys not seen before) and announce them."""
    existing = by_keys(db, [t.key for t in timers if t.key is not None])
    new = [t for t in timers if t.key not in existing]
    insert_many(db, new)
    announce(db, new, now_ms, per_shard=len(new) > 1)


def cancel_wake(db: str, key: str, now_ms: int) -> None:
    """Cancel the pending wake-up under ``key`` (a signal came before its timeout)."""
    Timer.objects.using(db).filter(key=key, state=TimerState.PENDING).update(
        state=TimerState.CANCELED, updated_at=ms_to_dt(now_ms)
    )


# -- operations ------------------------------------------------------------------------


def lock_run(db: str, run_id: str) -> WorkflowRun | None:
    """The run, locked until the end of the caller's transaction; None if unknown."""
    return WorkflowRun.objects.using(db).select_for_update().filter(pk=run_id).first()


def add_signal(db: str, run_id: str, name: str, payload: Any, now_ms: int) -> WorkflowSignal:
    """Store a signal for the run, sent at ``now_ms``."""
    return WorkflowSignal.objects.using(db).create(
        run_id=run_id, name=name, payload=payload, created_at=ms_to_dt(now_ms)
    )


def cancel_tree(db: str, root: WorkflowRun, now_ms: int) -> list[str]:
    """Cancel ``root`` and its unfinished descendants, their pending wake-ups and scheduled
    signals.

    Walks every child whatever its state, so a finished child does not shield its own
    running children. Returns the ids cancelled, root first.
    """
    cancelled = [root.pk]
    level = [root.pk]
    seen = {root.pk}
    while level:
        children = list(
            WorkflowRun.objects.using(db)
            .select_for_update()
            .filter(parent_id__in=level)
            .values_list("id", "state")
        )
        level = [pk for pk, _ in children if pk not in seen]
        seen.update(level)
        cancelled += [pk for pk, state in children if state in ACTIVE]
    when = ms_to_dt(now_ms)
    shards: dict[int, list[str]] = {}
    for start in range(0, len(cancelled), _CHUNK):
        chunk = cancelled[start : start + _CHUNK]
        runs = WorkflowRun.objects.using(db).filter(pk__in=chunk, state__in=ACTIVE)
        for pk, shard in runs.values_list("id", "shard"):
            shards.setdefault(shard, []).append(pk)
        runs.update(
            state=WorkflowState.CANCELED,
            wait_signal="",
            wait_seq=None,
            finished_at=when,
            updated_at=when,
        )
    for shard, ids in shards.items():
        # The pending-timer index serves (shard, state): no scan of other shards.
        Timer.objects.using(db).filter(
            shard=shard,
            state=TimerState.PENDING,
            kind__in=(TimerKind.WORKFLOW, TimerKind.SIGNAL),  # wake-ups, scheduled signals
            target__in=ids,
        ).update(state=TimerState.CANCELED, updated_at=when)
    # Their slots (and those of woken start timers just cancelled) go to the next in line.
    run_slots.release_runs(db, cancelled, now_ms, get_settings().BUCKET_SHIFT)
    return cancelled


def reopen(db: str, run: WorkflowRun, now_ms: int) -> None:
    """Put a failed run back to pending; a trailing failed step gets fresh attempts."""
    last = WorkflowStep.objects.using(db).filter(run_id=run.pk).order_by("-seq").first()
    if last is not None and last.status == "failed":
        last.delete()
    WorkflowRun.objects.using(db).filter(pk=run.pk).update(
        state=WorkflowState.PENDING,
        error="",
        finished_at=None,
        retries=F("retries") + 1,
        updated_at=ms_to_dt(now_ms),
    )


def history(db: str, run_id: str) -> list[dict[str, Any]]:
    """Every recorded step of the run, by seq."""
    steps = WorkflowStep.objects.using(db).filter(run_id=run_id).order_by("seq")
    return list(steps.values(*STEP_FIELDS))


def runs(db: str) -> Any:
    """All runs on ``db``, as a ``WorkflowRunQuerySet`` to filter further."""
    return WorkflowRun.objects.using(db).all()
