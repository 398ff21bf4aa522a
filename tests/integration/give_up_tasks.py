"""A Django task that gives up; imported once the durable Tasks backend is configured."""

from __future__ import annotations

import durable
from testproject.demo.models import FireRecord

try:
    from django.tasks import task
except ImportError:
    from django_tasks import task  # type: ignore[no-redef]


@task
def refuses(key: str) -> None:
    """Records its run, then fails for good."""
    FireRecord.objects.create(key=key, fired_at_ms=0)
    raise durable.GiveUp(f"{key}: nothing to do")
