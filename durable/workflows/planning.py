"""Checking a start before anything is written, and naming child runs.

Used by ``.start()``/``.start_many()`` (application code) and by ``ctx.start_child``
(workflow code): the arguments must bind to the workflow's signature and be JSON (the
error names the path), a model-method workflow needs a saved row, a run id is 1 to 100
characters without spaces or ``:`` (it is part of timer keys).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from typing import Any

from django.db import models

from durable.conf import get_settings
from durable.exceptions import WorkflowError
from durable.scheduling.validation import check_payload, check_text
from durable.workflows.records import ChildRequest
from durable.workflows.registry import METHOD, BoundWorkflow, Workflow, WorkflowDef
from durable.workflows.slots import key_for

RUN_ID = re.compile(r"[^\s:]{1,100}")
_CHILD_NAMESPACE = uuid.UUID("8c5b0f3e-6d1e-4d7a-9a51-2f4c0c8e6a10")


def target_of(workflow: Any) -> tuple[WorkflowDef, models.Model | None]:
    """``(definition, bound instance)`` for anything that can be started."""
    if isinstance(workflow, BoundWorkflow):
        return workflow.definition, workflow.instance
    if (
        isinstance(workflow, type)
        and issubclass(workflow, Workflow)
        and "definition" in vars(workflow)
    ):
        return workflow.definition, None
    if isinstance(workflow, WorkflowDef):
        if workflow.shape == METHOD:
            raise TypeError(f"{workflow.name} is bound to a model row: pass instance.method")
        return workflow, None
    raise TypeError(
        f"expected a @durable.workflow, a durable.Workflow subclass or a bound model "
        f"method, got {workflow!r}"
    )


def plan_fields(
    definition: WorkflowDef,
    instance: models.Model | None,
    args: Iterable[Any],
    kwargs: dict[str, Any] | None,
    run_id: str | None,
    where: str = "",
) -> dict[str, Any]:
    """Validate a start and return the run's fields (id, name, args, binding, and its
    concurrency key: ``None`` for a workflow without limits)."""
    conf = get_settings()
    args = tuple(args)
    kwargs = dict(kwargs or {})
    binding = {"model_label": "", "object_pk": ""}
    if definition.shape == METHOD:
        binding = _binding(definition, instance)
    definition.check_call(instance, args, kwargs)
    args_list, kwargs_dict = check_payload(args, kwargs, None, conf.MAX_PAYLOAD_BYTES, where)
    if run_id is None:
        run_id = uuid.uuid4().hex
    elif not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise ValueError(
            f"{where + '.' if where else ''}run_id: expected 1 to 100 characters without "
            f"spaces or ':', got {run_id!r}"
        )
    check_text(run_id, "run_id", where)  # the id is a text column: no NUL, no surrogate
    fields = {"id": run_id, "name": definition.name, "args": args_list, "kwargs": kwargs_dict}
    fields["concurrency_key"] = key_for(definition, args_list, kwargs_dict)
    return fields | binding


def _binding(definition: WorkflowDef, instance: Any) -> dict[str, str]:
    model = definition.model
    if instance is None or not isinstance(instance, models.Model):
        raise TypeError(f"{definition.name} runs on a model row: start it from an instance")
    if model is not None and not isinstance(instance, model):
        raise TypeError(f"{definition.name}: expected a {model.__name__}, got {instance!r}")
    if instance.pk is None or instance._state.adding:
        raise WorkflowError(
            f"{definition.name}: this {type(instance).__name__} is not saved; save it "
            "before starting a workflow bound to it",
            workflow=definition.name,
        )
    return {"model_label": instance._meta.label_lower, "object_pk": str(instance.pk)}


def plan_child(
    workflow: Any, args: tuple[Any, ...], kwargs: dict[str, Any], run_id: str
) -> ChildRequest:
    """Validate a child start from workflow code (nothing is written)."""
    definition, instance = target_of(workflow)
    fields = plan_fields(definition, instance, args, kwargs, run_id)
    return ChildRequest(
        run_id=fields["id"],
        name=fields["name"],
        args=fields["args"],
        kwargs=fields["kwargs"],
        model_label=fields["model_label"],
        object_pk=fields["object_pk"],
        concurrency_key=fields["concurrency_key"],
    )


def child_id(parent_id: str, seq: int) -> str:
    """The default id of the child started at ``seq``: stable, so replay finds it."""
    return uuid.uuid5(_CHILD_NAMESPACE, f"{parent_id}/{seq}").hex
