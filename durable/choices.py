"""The states and kinds durable's rows store: timer states and kinds, workflow run states.

Plain ``TextChoices``, kept apart from the models that use them so code that only
compares states reads them here; ``durable.models`` re-exports every one, and the
migrations spell the choices out, so where the classes live does not touch them.
"""

from __future__ import annotations

from django.db import models


class TimerState(models.TextChoices):
    """Life cycle of a timer: pending → (firing →) fired | failed; pending → canceled."""

    PENDING = "pending", "pending"
    FIRING = "firing", "firing (claimed by an external handler)"
    FIRED = "fired", "fired"
    FAILED = "failed", "failed (dead letter)"
    CANCELED = "canceled", "canceled"


#: Every ``TimerState`` but fired: the rows ``durable_timer_unfired_idx`` holds.
UNFIRED_STATES = [TimerState.PENDING, TimerState.FIRING, TimerState.FAILED, TimerState.CANCELED]


class TimerKind(models.TextChoices):
    """What firing a timer does."""

    HANDLER = "handler", "handler"
    CELERY = "celery", "Celery task"
    WORKFLOW = "workflow", "workflow wake-up"
    CRON = "cron", "cron occurrence"
    TASK = "task", "Django task"
    SIGNAL = "signal", "scheduled signal"


class WorkflowState(models.TextChoices):
    """Life cycle of a workflow run.

    pending → running → (sleeping | waiting → running)* → completed | failed; any
    unfinished state → canceled. A failed run can be retried (back to pending).
    """

    PENDING = "pending", "pending"
    RUNNING = "running", "running"
    SLEEPING = "sleeping", "sleeping"
    WAITING = "waiting", "waiting"
    COMPLETED = "completed", "completed"
    FAILED = "failed", "failed"
    CANCELED = "canceled", "canceled"
