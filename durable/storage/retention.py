"""Queries of retention: delete finished timers and workflow runs past their time.

Fired and cancelled timers (:func:`prune_finished`), dead-lettered timers and finished
workflow runs. Everything deletes a
bounded batch per call, in its own short transaction, and is called by the worker's
housekeeping between turns, never inside a firing transaction.

A run is deleted only with its whole tree (the run, its descendant runs, and every one's
steps and signals), and only when every run of the tree finished before the cutoff and
none has a pending or firing wake-up timer. Deleting part of a tree would break what the
rest relies on: an unfinished parent's ``wait_child`` reads its child's row, and
``cancel_workflow`` walks down through finished runs to reach running grandchildren.
Within an eligible tree, rows go deepest first, children (steps, signals) before runs,
so a batch that stops mid-tree leaves a smaller tree that is still eligible.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import connections, transaction
from django.db.models import Exists, OuterRef, Q

from durable.models import (
    Timer,
    TimerKind,
    TimerState,
    WorkflowRun,
    WorkflowSignal,
    WorkflowState,
    WorkflowStep,
)
from durable.storage.leases import ms_to_dt

ACTIVE = WorkflowRun.ACTIVE_STATES
# Spelled out: the partial index durable_wfrun_done_idx (migration 0010) names them too.
FINISHED = ("completed", "failed", "canceled")
assert {*FINISHED, *ACTIVE} == set(WorkflowState.values), "a new run state needs a side"
_CHUNK = 500
# Roots looked at per call at most, eligible or not: a page of roots whose trees must
# wait (a run still going) costs a few queries, and the next pages are still reached.
_MAX_PAGES = 10


def cutoff_ms(now_ms: int, days: float) -> int:
    """The instant before which rows finished ``days`` ago or more may be pruned."""
    return now_ms - int(timedelta(days=days).total_seconds() * 1000)


def prune_finished(db: str, older_than_ms: int, batch: int = 1000) -> int:
    """Delete up to ``batch`` fired/cancelled rows last updated before ``older_than_ms``.

    The oldest ids (``durable_timer_done_idx``), the ``parent`` link of their children
    cleared (what ``on_delete=SET_NULL`` does; children keep their rows), and one
    ``DELETE`` by id: on PostgreSQL all in one statement (one round trip, see
    :func:`_prune_finished_in_one_statement`), elsewhere three in one short transaction.
    Not ``QuerySet.delete()``: for ``SET_NULL`` Django loads every row whole and deletes
    in chunks of 100: 150-360 ms per 1,000 rows against 55-130 ms with three statements
    (``bench/prune_batch.py``, load 6-11; docs/benchmarks.md, "Soak"), and pruning runs
    on the worker's loop. Fired and cancelled are final states, and the rows are locked
    when read, so they are still prunable when deleted.
    """
    cutoff = ms_to_dt(older_than_ms)
    if connections[db].vendor == "postgresql" and not foreign_keys_to_timers():
        return _prune_finished_in_one_statement(db, cutoff, batch)
    return _prune_finished_in_transaction(db, cutoff, batch)


def _prune_finished_in_transaction(db: str, cutoff: object, batch: int) -> int:
    """:func:`prune_finished` in three statements (or Django's ``delete()``), one transaction."""
    rows = Timer.objects.using(db).filter(
        state__in=[TimerState.FIRED, TimerState.CANCELED], updated_at__lt=cutoff
    )
    if connections[db].features.has_select_for_update_skip_locked:
        # Every worker prunes the whole table: rows another one is deleting are skipped,
        # not waited for (its batch commits, ours takes the next rows).
        rows = rows.select_for_update(skip_locked=True)
    with transaction.atomic(using=db):
        ids = list(rows.order_by("updated_at").values_list("id", flat=True)[:batch])
        if not ids:
            return 0
        if foreign_keys_to_timers():
            # A model of the project points at timers: Django's delete() applies its
            # on_delete (the slow path, but the project's rules hold).
            deleted, _ = Timer.objects.using(db).filter(id__in=ids).delete()
            return int(deleted)
        Timer.objects.using(db).filter(parent_id__in=ids).update(parent=None)
        marks = ", ".join(["%s"] * len(ids))
        with connections[db].cursor() as cursor:
            cursor.execute(f"DELETE FROM {Timer._meta.db_table} WHERE id IN ({marks})", ids)
            return int(cursor.rowcount)


#: :func:`prune_finished` on PostgreSQL: the three steps in one statement, so one round
#: trip and its own (autocommit) transaction. Children that are doomed themselves are
#: left to the DELETE (a statement must not modify a row twice).
_PRUNE_SQL = """
WITH doomed AS (
    SELECT id FROM {table}
    WHERE state IN (%s, %s) AND updated_at < %s
    ORDER BY updated_at LIMIT %s
    FOR UPDATE SKIP LOCKED
), orphaned AS (
    UPDATE {table} SET parent_id = NULL
    WHERE parent_id IN (SELECT id FROM doomed) AND id NOT IN (SELECT id FROM doomed)
)
DELETE FROM {table} WHERE id IN (SELECT id FROM doomed)
"""


def _prune_finished_in_one_statement(db: str, cutoff: object, batch: int) -> int:
    """:func:`prune_finished` as one statement (PostgreSQL, no project key to timers).

    Outside a transaction it is its own: one round trip where the three statements in a
    transaction took five (``BEGIN`` and ``COMMIT`` included); 17-26 ms per batch of
    50-200 on a loaded machine went mostly on those trips (``bench/prune_batch.py``).
    """
    sql = _PRUNE_SQL.format(table=Timer._meta.db_table)
    params = [TimerState.FIRED.value, TimerState.CANCELED.value, cutoff, batch]
    with connections[db].cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


def foreign_keys_to_timers() -> list[str]:
    """Foreign keys to ``Timer`` other than its own ``parent``: ``app.Model.field`` each.

    With none, :func:`prune_finished` deletes by id in one statement; with any, it goes
    through Django's ``delete()`` so that their ``on_delete`` applies.
    """
    return [
        f"{rel.related_model._meta.label}.{rel.field.name}"
        for rel in Timer._meta.related_objects
        if not (rel.related_model is Timer and rel.field.name == "parent")
    ]


def prune_failed_timers(db: str, older_than_ms: int, batch: int = 1000) -> int:
    """Delete up to ``batch`` failed (dead-lettered) timers that failed before ``older_than_ms``.

    Failed rows are few (dead letters), so ``durable_timer_unfired_idx`` serves this
    without an index of its own. Their children keep their rows (``parent`` is cleared by
    SET_NULL).
    """
    rows = Timer.objects.using(db).filter(
        state=TimerState.FAILED, updated_at__lt=ms_to_dt(older_than_ms)
    )
    ids = list(rows.order_by("updated_at").values_list("id", flat=True)[:batch])
    if not ids:
        return 0
    deleted, _ = Timer.objects.using(db).filter(id__in=ids, state=TimerState.FAILED).delete()
    return deleted


@dataclass(slots=True)
class _Tree:
    """A root run and its descendants, level by level (root level first)."""

    root: str
    levels: list[list[str]] = field(default_factory=list)
    take: list[str] = field(default_factory=list)  # what this batch deletes of it

    def deepest_first(self) -> list[str]:
        return [run_id for level in reversed(self.levels) for run_id in level]


def prune_runs(db: str, older_than_ms: int, batch: int = 500) -> int:
    """Delete up to ``batch`` finished runs (whole trees, see the module) with their steps
    and signals, in one transaction; return how many runs were deleted."""
    cutoff = ms_to_dt(older_than_ms)
    chosen: list[_Tree] = []
    budget = batch
    after: tuple[object, str] | None = None
    for _ in range(_MAX_PAGES):
        page = _roots(db, cutoff, after, batch)
        if not page:
            break
        after = page[-1]
        for tree in _eligible_trees(db, [root for _, root in page], cutoff):
            tree.take = tree.deepest_first()[:budget]
            chosen.append(tree)
            budget -= len(tree.take)
            if not budget:
                return _delete_trees(db, chosen, cutoff)
        if len(page) < batch:
            break
    return _delete_trees(db, chosen, cutoff) if chosen else 0


def _roots(
    db: str, cutoff: object, after: tuple[object, str] | None, limit: int
) -> list[tuple[object, str]]:
    """``(finished_at, id)`` of finished top-level runs finished before ``cutoff``, oldest first.

    Served by the partial index ``durable_wfrun_done_idx``. Roots with a direct child
    still going or finished too recently are left out here already (the common reason a
    tree must wait), so they do not fill every page.
    """
    busy_child = WorkflowRun.objects.filter(parent_id=OuterRef("pk")).filter(
        Q(state__in=ACTIVE) | Q(finished_at__isnull=True) | Q(finished_at__gte=cutoff)
    )
    rows = WorkflowRun.objects.using(db).filter(
        state__in=FINISHED, parent__isnull=True, finished_at__lt=cutoff
    )
    if after is not None:
        rows = rows.filter(Q(finished_at__gt=after[0]) | Q(finished_at=after[0], id__gt=after[1]))
    rows = rows.exclude(Exists(busy_child)).order_by("finished_at", "id")
    return list(rows.values_list("finished_at", "id")[:limit])


def _eligible_trees(db: str, roots: Sequence[str], cutoff: object) -> list[_Tree]:
    """The trees of ``roots`` whose every run finished before ``cutoff`` with no live wake-up."""
    trees = {root: _Tree(root, [[root]]) for root in roots}
    root_of = {root: root for root in roots}
    blocked: set[str] = set()
    level = list(roots)
    while level:
        found: dict[str, list[str]] = {}
        nxt = []
        for chunk in _chunks(level):
            children = WorkflowRun.objects.using(db).filter(parent_id__in=chunk)
            for pk, parent, state, finished in children.values_list(
                "id", "parent_id", "state", "finished_at"
            ):
                if pk in root_of:  # parent links are acyclic by construction; be sure
                    continue
                root = root_of[pk] = root_of[parent]
                found.setdefault(root, []).append(pk)
                nxt.append(pk)
                if state not in FINISHED or finished is None or finished >= cutoff:
                    blocked.add(root)
        for root, ids in found.items():
            trees[root].levels.append(ids)
        level = nxt
    blocked.update(root_of[run_id] for run_id in _with_live_wakeups(db, root_of))
    return [tree for root, tree in trees.items() if root not in blocked]


def _with_live_wakeups(db: str, run_ids: Iterable[str]) -> set[str]:
    """Those of ``run_ids`` with a pending or firing wake-up timer.

    Found through the key: every wake-up of a run has a key ``wf:<run id>:...``
    (:func:`durable.storage.workflows.wake_key`) and targets the run. A key prefix is an
    index range (PostgreSQL: Django's ``varchar_pattern_ops`` index on the key; SQLite:
    the unique index, binary collation), so the cost follows the runs' own timers, not
    the number of pending timers.
    """
    vendor = connections[db].vendor
    live: set[str] = set()
    for chunk in _chunks(sorted(run_ids), 100):
        match = Q()
        for run_id in chunk:
            prefix = f"wf:{run_id}:"
            if vendor == "sqlite":  # its LIKE ignores case and no index serves it
                match |= Q(key__gte=prefix, key__lt=f"wf:{run_id};", target=run_id)
            else:
                match |= Q(key__startswith=prefix, target=run_id)
        rows = Timer.objects.using(db).filter(match, kind=TimerKind.WORKFLOW)
        live.update(
            rows.filter(state__in=(TimerState.PENDING, TimerState.FIRING)).values_list(
                "target", flat=True
            )
        )
    return live


def _delete_trees(db: str, trees: list[_Tree], cutoff: object) -> int:
    """Delete the runs each tree ``take``s, deepest first; return how many were deleted.

    One transaction: the runs are locked (in id order, skipping rows locked elsewhere)
    and checked again; a tree with a run locked elsewhere, retried or given a child
    since it was read is left whole. ``retry``, ``send_signal`` and a replay's
    checkpoint all lock the run row first, so they wait for this and then find the run
    gone or kept.
    """
    ids = sorted(run_id for tree in trees for run_id in tree.take)
    known = {run_id for tree in trees for level in tree.levels for run_id in level}
    with transaction.atomic(using=db):
        locked: set[str] = set()
        for chunk in _chunks(ids):
            rows = WorkflowRun.objects.using(db).filter(
                pk__in=chunk, state__in=FINISHED, finished_at__lt=cutoff
            )
            features = connections[db].features
            if features.has_select_for_update:
                # Skip, never wait: a run locked by another worker's pruning or by a
                # retry leaves its tree for a later pass, and the loop goes on.
                skip = features.has_select_for_update_skip_locked
                rows = rows.select_for_update(skip_locked=skip).order_by("pk")
            locked.update(rows.values_list("id", flat=True))
        changed = _with_new_children(db, ids, known)
        # Each tree's list is deepest first, so in the concatenation every run comes
        # after its children: deleting chunk by chunk never orphans one.
        doomed = [
            run_id
            for tree in trees
            if locked.issuperset(tree.take) and changed.isdisjoint(tree.take)
            for run_id in tree.take
        ]
        for chunk in _chunks(doomed):
            WorkflowStep.objects.using(db).filter(run_id__in=chunk).delete()
            WorkflowSignal.objects.using(db).filter(run_id__in=chunk).delete()
        for chunk in _chunks(doomed):
            WorkflowRun.objects.using(db).filter(pk__in=chunk).delete()
    return len(doomed)


def _with_new_children(db: str, ids: list[str], known: set[str]) -> set[str]:
    """Those of ``ids`` with a child run not seen when the trees were read."""
    changed: set[str] = set()
    for chunk in _chunks(ids):
        children = WorkflowRun.objects.using(db).filter(parent_id__in=chunk)
        changed.update(
            parent for pk, parent in children.values_list("id", "parent_id") if pk not in known
        )
    return changed


def past_retention(db: str, now_ms: int, days: float | None, what: str, cap: int = 1000) -> int:
    """How many rows of ``what`` (``"timers"``, ``"failed"``, ``"runs"``) are past
    ``days``, counting at most ``cap`` (0 when ``days`` is None: nothing is pruned)."""
    if days is None:
        return 0
    cutoff = ms_to_dt(cutoff_ms(now_ms, days))
    if what == "runs":  # top-level runs (trees), through durable_wfrun_done_idx
        rows = WorkflowRun.objects.using(db).filter(
            state__in=FINISHED, parent__isnull=True, finished_at__lt=cutoff
        )
    elif what == "failed":
        rows = Timer.objects.using(db).filter(state=TimerState.FAILED, updated_at__lt=cutoff)
    else:
        rows = Timer.objects.using(db).filter(
            state__in=(TimerState.FIRED, TimerState.CANCELED), updated_at__lt=cutoff
        )
    return rows.values("pk")[:cap].count()


def _chunks(items: list[str], size: int = _CHUNK) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]
