"""durable's Django admin: one module per group of models, registered on import.

``django.contrib.admin`` autodiscovers ``durable.admin``; importing the submodules here
registers ``Timer`` (:mod:`.timers`), ``CronSchedule`` (:mod:`.schedules`),
``WorkflowRun`` with its steps and signals (:mod:`.workflows`), and ``ShardLease``,
``WorkerNode`` and the overview page (:mod:`.cluster`). See ``docs/how-to/admin.md``.
"""

from durable.admin import cluster, schedules, timers, workflows

__all__ = ["cluster", "schedules", "timers", "workflows"]
