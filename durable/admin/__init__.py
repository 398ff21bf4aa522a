"""durable's Django admin: one module per group of models, registered on import.

``django.contrib.admin`` autodiscovers ``durable.admin``; importing the submodules here
registers ``Timer`` (:mod:`.timers`), ``CronSchedule`` (:mod:`.schedules`),
``WorkflowRun`` with its steps and signals (:mod:`.workflows`), and ``ShardLease``,
``WorkerNode`` and the overview page (:mod:`.cluster`). See ``docs/how-to/admin.md``.

:class:`RunTimelineMixin` is for your own ``ModelAdmin``: the timelines of the workflow
runs bound to a row, on that row's page (:mod:`.timelines`).
"""

from durable.admin import cluster, schedules, timers, workflows
from durable.admin.timelines import RunTimelineMixin

__all__ = ["RunTimelineMixin", "cluster", "schedules", "timers", "workflows"]
