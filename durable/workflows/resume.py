"""The ``workflow`` timer kind: a wake-up timer resumes its run by replaying it.

Every timer of a run (start, sleep end, step retry, signal, child finished, retry)
has kind ``workflow`` and the run id as target. The firer resolves it here into an
``atomic=False`` handler: the timer is claimed in the batch transaction, and the replay
runs on the worker's executor with transactions of its own, one per checkpoint, each
fenced with the lease token the firer took the timer under. A long step therefore
holds no batch transaction and no lock while it runs, and a worker that lost the shard
commits nothing. If the worker dies mid-replay, the claim expires and the timer fires
again: the replay starts over from the recorded history.

Wake-ups whose replay performs nothing live (a sleep that ends, say) are replayed
inside the firing batch instead (:mod:`durable.workflows.inline`, the kind's batch
scope). The runs that scope found needing the executor are marked running in the batch,
their timers claimed in the same statement, and their histories handed over
(:class:`~durable.workflows.runguard.Handovers`), so their replay need not read them
again.

Within one worker, :class:`~durable.workflows.runguard.RunGuard` sees to it that a run
is never replayed by two threads at once and that no wake-up is lost to a busy run.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from django.apps import apps
from django.db import models, transaction

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.errors import sanitize_error
from durable.dispatch.context import current_fire
from durable.dispatch.kinds import (
    FiringBatch,
    register_batch_scope,
    register_dead_letter,
    register_kind,
)
from durable.dispatch.registry import HandlerSpec
from durable.exceptions import WorkflowError
from durable.models import WorkflowState
from durable.storage import checkpoints as cp
from durable.storage import run_slots
from durable.storage import workflows as store
from durable.storage.leases import fence
from durable.workflows.backend import DatabaseBackend, event
from durable.workflows.context import WorkflowContext
from durable.workflows.execute import COMPLETED, FAILED, execute
from durable.workflows.inline import InlineBatch, replaying
from durable.workflows.records import Record, RunStopped
from durable.workflows.registry import WorkflowDef, workflows
from durable.workflows.runguard import Handovers, RunGuard

__all__ = ["RunGuard", "WorkflowKind", "kind", "replay", "resume_once"]


class WorkflowKind:
    """Resolver of the ``workflow`` timer kind (registered with the firer at import)."""

    def __init__(self) -> None:
        self.guard = RunGuard()
        self._local = threading.local()  # .batch: the firing thread's InlineBatch, if any
        self.handovers = Handovers()

    def resolve(self, run_id: str) -> HandlerSpec:
        """The handler of a wake-up of run ``run_id``.

        Inside a firing batch whose scope replayed the run to its end or its next sleep,
        an atomic handler that only reports it (the batch writes the replay); otherwise
        one that resumes the run on the executor, outside the batch transaction.
        """
        batch: InlineBatch | None = getattr(self._local, "batch", None)
        if batch is not None and run_id in batch.backends:
            return HandlerSpec(name=f"workflow:{run_id}", fn=partial(batch.fire, run_id))
        # No deadline for a whole replay: its steps may run long by design, and an
        # abandoned replay would keep its run's guard. The claim timeout still covers a
        # replay that never returns.
        return HandlerSpec(
            name=f"workflow:{run_id}",
            fn=partial(self.resume, run_id),
            atomic=False,
            timeout=math.inf,
        )

    @contextmanager
    def batch_scope(self, db: str, timers: Sequence[Any], firing: FiringBatch) -> Iterator[None]:
        """The kind's batch scope: replay the batch's runs inline where that is enough."""
        with replaying(db, timers, firing, self.guard, replay, self.handovers) as batch:
            self._local.batch = batch
            try:
                yield
            finally:
                self._local.batch = None

    def resume(self, run_id: str) -> str:
        """Replay the run until it suspends or ends; return the state it reached."""
        if not self.guard.enter(run_id):
            return "busy"
        try:
            state = resume_once(run_id, self.handovers.take(run_id))
            while self.guard.again(run_id):
                state = resume_once(run_id)
        except BaseException:
            self.guard.leave(run_id)
            raise
        return state


def resume_once(run_id: str, snapshot: cp.RunSnapshot | None = None) -> str:
    """Replay run ``run_id`` once, from the top of its code; return where it stands.

    Called by the worker with the fire context set (its lease is checked in every
    transaction); called without one, it runs unfenced, which only tests should do.
    ``snapshot``: the run as the firing batch read it and marked it running (then it is
    not read again).
    """
    db = get_settings().DATABASE
    fire = current_fire()
    lease = (fire.shard, fire.token) if fire and fire.token is not None else None
    clock = current_clock()
    floor_ms = fire.fired_ms if fire else 0
    if snapshot is None:
        with transaction.atomic(using=db):
            if lease is not None:
                fence(db, lease[0], lease[1])
            snapshot = cp.begin(db, run_id, max(clock.now_ms(), floor_ms))
    if snapshot is None:
        return "finished"
    history = [Record(**step) for step in snapshot.steps]
    backend = DatabaseBackend(
        db=db,
        run_id=run_id,
        shard=snapshot.shard,
        lease=lease,
        clock=clock,
        floor_ms=floor_ms,
        recorded=history,
        parent_id=snapshot.parent_id,
        keyed=snapshot.concurrency_key is not None,
    )
    return replay(backend, snapshot, history)


def replay(backend: Any, snapshot: cp.RunSnapshot, history: list[Record]) -> str:
    """Run the run's code once against ``backend``; return the state it reached."""
    try:
        definition = workflows.resolve(snapshot.name)
        instance = _bound(snapshot)
    except WorkflowError as exc:  # its code or its row is gone: the run fails, not the worker
        return _fail(backend, snapshot.name, exc)
    return _replay(backend, definition, instance, snapshot, history)


def _replay(
    backend: Any,
    definition: WorkflowDef,
    instance: models.Model | None,
    snapshot: cp.RunSnapshot,
    history: list[Record],
) -> str:
    ctx = WorkflowContext(
        run_id=snapshot.id,
        history=history,
        backend=backend,
        policy=definition.policy(),
        strict=definition.strict,
    )
    args, kwargs = snapshot.args, snapshot.kwargs
    try:
        outcome = execute(ctx, lambda c: definition.invoke(c, instance, args, kwargs))
        if outcome.state == COMPLETED:
            backend.finish(WorkflowState.COMPLETED, result=outcome.result)
            event(logging.DEBUG, "workflow.completed", run=snapshot.id, workflow=snapshot.name)
            return COMPLETED
        if outcome.state == FAILED:
            assert outcome.error is not None
            return _fail(backend, snapshot.name, outcome.error)
    except RunStopped:
        return "stopped"
    return "suspended"


def _fail(backend: Any, name: str, error: BaseException) -> str:
    text = sanitize_error(error)
    try:
        backend.finish(WorkflowState.FAILED, error=text)
    except RunStopped:
        return "stopped"
    event(logging.WARNING, "workflow.failed", run=backend.run_id, workflow=name, error=text)
    return FAILED


def _bound(snapshot: cp.RunSnapshot) -> Any:
    if not snapshot.model_label:
        return None
    try:
        model = apps.get_model(snapshot.model_label)
    except (LookupError, ValueError):
        raise WorkflowError(
            f"the model {snapshot.model_label!r} this run is bound to no longer exists"
        ) from None
    try:
        return model._base_manager.get(pk=snapshot.object_pk)
    except model.DoesNotExist:
        raise WorkflowError(
            f"the {model.__name__} row pk={snapshot.object_pk} this run is bound to "
            "no longer exists"
        ) from None


def fail_run(db: str, timer: Any, error: str, now_ms: int) -> None:
    """The workflow kind's dead-letter hook: a run whose wake-up timer used up its
    attempts (its replay kept crashing or hanging its worker, say) fails, rather than
    stay ``running`` with nothing left to wake it; its parent, if any, is woken."""
    text = f"its wake-up timer {timer.id} was dead-lettered: {error}"[:500]
    ended = cp.fail_unfinished(db, timer.target, text, now_ms)
    if ended is None:
        return
    run_slots.release_runs(db, [timer.target], now_ms, get_settings().BUCKET_SHIFT)
    event(logging.ERROR, "workflow.failed", run=timer.target, error=text)
    parent = ended
    if parent:
        key = store.wake_key(parent, "child", timer.target)
        store.ensure_wake(db, parent, store.shard_of(db, parent), key, now_ms, now_ms)


kind = WorkflowKind()
register_kind("workflow", kind.resolve)
register_batch_scope("workflow", kind.batch_scope)
register_dead_letter("workflow", fail_run)
