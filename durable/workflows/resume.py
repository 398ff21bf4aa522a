"""The ``workflow`` timer kind: a wake-up timer resumes its run by replaying it.

Every timer of a run (start, sleep end, step retry, signal, child finished, retry)
has kind ``workflow`` and the run id as target. The firer resolves it here into an
``atomic=False`` handler: the timer is claimed in the batch transaction, and the replay
runs on the worker's executor with transactions of its own, one per checkpoint, each
fenced with the lease token the firer took the timer under. A long step therefore
holds no batch transaction and no lock while it runs, and a worker that lost the shard
commits nothing. If the worker dies mid-replay, the claim expires and the timer fires
again: the replay starts over from the recorded history.

Within one worker, two wake-ups of the same run can be fired at once (a signal arrives
while a sleep ends). :class:`RunGuard` lets one replay run; the other returns at once
and asks the first to go round again, so no wake-up is lost and the run is never
replayed by two threads at the same time. Across workers, the lease does that job.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any

from django.apps import apps
from django.db import models, transaction

from durable.apps import current_clock
from durable.conf import get_settings
from durable.core.errors import sanitize_error
from durable.dispatch.context import current_fire
from durable.dispatch.kinds import register_kind
from durable.dispatch.registry import HandlerSpec
from durable.exceptions import WorkflowError
from durable.models import WorkflowState
from durable.storage import checkpoints as cp
from durable.storage.leases import fence
from durable.workflows.backend import DatabaseBackend, event
from durable.workflows.context import WorkflowContext
from durable.workflows.execute import COMPLETED, FAILED, execute
from durable.workflows.records import Record, RunStopped
from durable.workflows.registry import WorkflowDef, workflows


class RunGuard:
    """At most one replay per run in this process; a wake-up that finds it busy is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[str, bool] = {}  # run id -> another wake-up came meanwhile

    def enter(self, run_id: str) -> bool:
        """Take the run; False (and a note to go again) if another thread has it."""
        with self._lock:
            if run_id in self._busy:
                self._busy[run_id] = True
                return False
            self._busy[run_id] = False
            return True

    def again(self, run_id: str) -> bool:
        """True if a wake-up came during the replay (go again); else let the run go."""
        with self._lock:
            if self._busy.get(run_id):
                self._busy[run_id] = False
                return True
            self._busy.pop(run_id, None)
            return False

    def leave(self, run_id: str) -> None:
        """Let the run go (after an error)."""
        with self._lock:
            self._busy.pop(run_id, None)


class WorkflowKind:
    """Resolver of the ``workflow`` timer kind (registered with the firer at import)."""

    def __init__(self) -> None:
        self.guard = RunGuard()

    def resolve(self, run_id: str) -> HandlerSpec:
        """A handler that resumes run ``run_id``, outside the batch transaction."""
        return HandlerSpec(name=f"workflow:{run_id}", fn=partial(self.resume, run_id), atomic=False)

    def resume(self, run_id: str) -> str:
        """Replay the run until it suspends or ends; return the state it reached."""
        if not self.guard.enter(run_id):
            return "busy"
        try:
            state = resume_once(run_id)
            while self.guard.again(run_id):
                state = resume_once(run_id)
        except BaseException:
            self.guard.leave(run_id)
            raise
        return state


def resume_once(run_id: str) -> str:
    """Replay run ``run_id`` once, from the top of its code; return where it stands.

    Called by the worker with the fire context set (its lease is checked in every
    transaction); called without one, it runs unfenced, which only tests should do.
    """
    db = get_settings().DATABASE
    fire = current_fire()
    lease = (fire.shard, fire.token) if fire and fire.token is not None else None
    clock = current_clock()
    floor_ms = fire.fired_ms if fire else 0
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
    )
    try:
        definition = workflows.resolve(snapshot.name)
        instance = _bound(snapshot)
    except WorkflowError as exc:  # its code or its row is gone: the run fails, not the worker
        return _fail(backend, snapshot.name, exc)
    return _replay(backend, definition, instance, snapshot, history)


def _replay(
    backend: DatabaseBackend,
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


def _fail(backend: DatabaseBackend, name: str, error: BaseException) -> str:
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


kind = WorkflowKind()
register_kind("workflow", kind.resolve)
