"""``manage.py demo``: run the worker on a small live workload and print what happens.

The worker is the real ``run_timer_shards`` in a subprocess; this process plays the web
app, scheduling timers in its own transactions. Capabilities not built yet are listed at
the start, plainly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from itertools import count
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction

import durable
from durable.models import Timer
from testproject.demo import workload

NOT_YET = "Celery publishing (needs a broker; see docs/how-to/replace-celery-eta.md)"


class Command(BaseCommand):
    help = "Feed the durable worker a small live workload and print what fires and when."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--duration", type=float, default=60.0, help="seconds to run")

    def handle(self, *args: Any, duration: float, **options: Any) -> None:
        vendor = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        self.stdout.write(f"durable demo for {duration:.0f} s on {vendor}")
        self.stdout.write(f"  not shown here: {NOT_YET}")
        env = {**os.environ, "DURABLE_RESCAN_INTERVAL_S": "0.25", "DURABLE_LOG_LEVEL": "WARNING"}
        worker = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "run_timer_shards",
                "--node",
                "demo-worker",
                "--duration",
                str(duration + 3),
            ],
            env=env,
        )
        try:
            self._feed(duration)
            time.sleep(3)
        finally:
            worker.terminate()
            worker.wait(timeout=30)
        self._summary()

    def _feed(self, duration: float) -> None:
        # A schedule created at run time, as an admin or a view would: every 5 seconds.
        durable.schedules.delete("demo-heartbeat")
        durable.schedules.create("demo-heartbeat", workload.heartbeat, every=timedelta(seconds=5))
        self.stdout.write("created schedule demo-heartbeat: every 5 s")
        deadline = time.monotonic() + duration
        for n in count(1):
            if time.monotonic() >= deadline:
                return
            with transaction.atomic():  # what a view would do: app rows and timers together
                durable.schedule(
                    workload.remind,
                    args=[f"order-{n}"],
                    delay=timedelta(seconds=2),
                    on_complete=workload.after,
                    context=n,
                )
                if n % 3 == 0:
                    durable.schedule(workload.flaky, args=[f"job-{n}"], delay=timedelta(seconds=1))
                if n % 4 == 0:
                    durable.schedule(workload.notify_outside, args=[f"user-{n}"])
                if n % 5 == 1:
                    workload.welcome.start(f"customer-{n}")
                doomed = durable.schedule(
                    workload.remind, args=[f"cancelled-{n}"], delay=timedelta(seconds=3)
                )
            self.stdout.write(f"scheduled batch {n}: reminder in 2 s, and one cancelled")
            durable.cancel(doomed)
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))

    def _summary(self) -> None:
        states: dict[str, int] = {}
        for state in Timer.objects.values_list("state", flat=True):
            states[state] = states.get(state, 0) + 1
        self.stdout.write(
            "timers by state: " + ", ".join(f"{k}={v}" for k, v in sorted(states.items()))
        )
