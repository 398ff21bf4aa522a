"""Durable workflows: code that survives crashes by replaying a recorded history.

Declare with ``@durable.workflow`` (a function or a Django model method) or by
subclassing ``durable.Workflow``; start with ``.start(...)``; the ``run_timer_shards``
worker runs it. Every ctx call (``ctx.step``, ``ctx.atomic``, ``ctx.sleep``,
``ctx.wait_for_signal``, ``ctx.now``...) is a checkpoint row committed in the same
database as your models; a sleeping or waiting run holds no thread and no memory.

Layout: ``registry`` (declaring and binding), ``start`` (writing runs), ``context``
(the ctx API and the replay rules), ``execute`` (running code once), ``backend`` (the
worker's checkpoints), ``resume`` (the ``workflow`` timer kind), ``operations``
(signal, cancel, retry, read), ``guard`` (strict mode), ``history`` (golden
replays), ``memory`` (in-memory runs for unit tests).
"""

from __future__ import annotations

from durable.workflows import scheduled  # noqa: F401  (registers the "signal" kind)
from durable.workflows.context import StepOptions, WorkflowContext
from durable.workflows.operations import cancel_workflow, get_result, retry, runs, send_signal
from durable.workflows.records import ChildHandle
from durable.workflows.registry import BoundWorkflow, Workflow, WorkflowDef, workflow, workflows

__all__ = [
    "BoundWorkflow",
    "ChildHandle",
    "StepOptions",
    "Workflow",
    "WorkflowContext",
    "WorkflowDef",
    "cancel_workflow",
    "get_result",
    "retry",
    "runs",
    "send_signal",
    "workflow",
    "workflows",
]
