"""durable: durable timers, schedules and workflows for Django, on your own database.

Only the public API lives here. Names are re-exported lazily (PEP 562) so that
``import durable`` stays cheap and does not touch Django's app registry before
``django.setup()``; ``__all__`` is pinned by ``tests/unit/test_public_api.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> "module:attribute"
_EXPORTS: dict[str, str] = {
    "DurableError": "durable.exceptions:DurableError",
    "GiveUp": "durable.exceptions:GiveUp",
    "handler": "durable.scheduling.handlers:handler",
    "schedule": "durable.scheduling.api:schedule",
    "schedule_many": "durable.scheduling.api:schedule_many",
    "cancel": "durable.scheduling.api:cancel",
    "schedule_celery": "durable.scheduling.celery:schedule_celery",
    "Backoff": "durable.core.backoff:Backoff",
    "current_fire": "durable.dispatch.context:current_fire",
    "cron": "durable.scheduling.cron:cron",
    "every": "durable.scheduling.cron:every",
    "Occurrence": "durable.scheduling.cron:Occurrence",
    "schedules": "durable.scheduling.schedules:schedules",
    "workflow": "durable.workflows.registry:workflow",
    "Workflow": "durable.workflows.registry:Workflow",
    "WorkflowContext": "durable.workflows.context:WorkflowContext",
    "send_signal": "durable.workflows.operations:send_signal",
    "cancel_workflow": "durable.workflows.operations:cancel_workflow",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    try:
        target = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'durable' has no attribute {name!r}") from None
    module_name, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
