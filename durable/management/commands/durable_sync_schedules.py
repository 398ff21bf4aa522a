"""``python manage.py durable_sync_schedules``: write declared schedules to the database.

The worker does the same at start; run this after a deploy that changes declarations to
apply them without restarting workers, or to check what a deploy would change.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from durable.exceptions import ScheduleError
from durable.scheduling.cron import sync_declared


class Command(BaseCommand):
    help = (
        "Create, update or pause CronSchedule rows so that they match @durable.cron, "
        "@durable.every and DURABLE['CRONS'] (idempotent)."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--database", default=None, help="database alias (default: DURABLE['DATABASE'])"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            report = sync_declared(options["database"])
        except ScheduleError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"schedules synced: {report}")
