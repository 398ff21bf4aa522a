"""Query helpers for durable's models: the filters behind ``WorkflowRun.objects``.

The model attaches :class:`WorkflowRunQuerySet` as its manager; ``durable.models``
re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import models

if TYPE_CHECKING:  # the string below names it for type checkers; importing it would cycle
    from durable.models import WorkflowRun  # noqa: F401


class WorkflowRunQuerySet(models.QuerySet["WorkflowRun"]):
    """Filters for listing runs: ``WorkflowRun.objects.active().named(wf)``."""

    def named(self, workflow: object) -> WorkflowRunQuerySet:
        """Runs of a workflow, given by its registered name or the decorated object."""
        return self.filter(name=getattr(workflow, "name", workflow))

    def active(self) -> WorkflowRunQuerySet:
        """Runs not finished yet (pending, running, sleeping or waiting)."""
        return self.filter(state__in=self.model.ACTIVE_STATES)

    def finished(self) -> WorkflowRunQuerySet:
        """Runs that completed, failed or were cancelled."""
        return self.exclude(state__in=self.model.ACTIVE_STATES)

    def for_object(self, obj: models.Model) -> WorkflowRunQuerySet:
        """Runs bound to a model instance (``@durable.workflow`` on one of its methods)."""
        return self.filter(model_label=obj._meta.label_lower, object_pk=str(obj.pk))
