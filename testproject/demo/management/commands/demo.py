"""``manage.py demo``: run the worker on a small live workload and print what happens."""

from __future__ import annotations

import time
from typing import Any

from django.core.management import get_commands
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Feed the durable worker a small live workload and print what fires and when."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--duration", type=float, default=60.0, help="seconds to run")

    def handle(self, *args: Any, duration: float, **options: Any) -> None:
        if "run_timer_shards" not in get_commands():
            self.stdout.write(
                "durable demo: the run_timer_shards worker is not built yet; nothing to run.\n"
                "Available now: settings, system checks, migrations. Missing: timers, the\n"
                "worker, cron schedules, workflows (see docs/index.md for status)."
            )
            time.sleep(min(duration, 1.0))
            return
