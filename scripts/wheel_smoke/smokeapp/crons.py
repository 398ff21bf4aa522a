"""A schedule: every installed app's ``crons.py`` is imported by durable's sync."""

from __future__ import annotations

from datetime import timedelta

import durable
from smokeapp.models import Fired


@durable.every(timedelta(seconds=1), catch_up="skip")
def tick(occurrence: durable.Occurrence) -> None:
    Fired.objects.create(what="cron")
