"""``python manage.py run_durable_executor``: run handlers the workers ship through kombu.

Used with ``DURABLE["DISPATCH"] = "kombu"``: the ``run_timer_shards`` workers claim due
timers and put them on the durable queue ``durable.executor`` of ``DURABLE["BROKER_URL"]``;
any number of executor processes, on any hosts, take them from there, run the handler
and commit its completion (fenced on the claim). SIGTERM finishes the message in hand.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from durable.checks import run_worker_checks
from durable.conf import get_settings
from durable.core.clock import SystemClock
from durable.discovery import discover
from durable.dispatch import kinds
from durable.dispatch.executors import EmbeddedExecutor
from durable.storage.leases import database_now_ms


class Command(BaseCommand):
    """``run_durable_executor [--threads N] [--broker URL] [--duration S]``."""

    help = "Run the handlers that run_timer_shards ships through kombu (DISPATCH = 'kombu')."
    # Checks run in handle() instead (as migrate does), so they can be given the database:
    # Django's default ("__all__") runs them without one, which skips the shard checks.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        """Declare the options."""
        parser.add_argument(
            "--skip-checks",
            action="store_true",
            help="skip the project's system checks (durable's own checks always run)",
        )
        parser.add_argument(
            "--threads", type=int, default=4, help="handlers run at once (one consumer each)"
        )
        parser.add_argument(
            "--broker", default=None, help='broker URL (default: DURABLE["BROKER_URL"])'
        )
        parser.add_argument(
            "--duration", type=float, default=None, help="stop cleanly after this many seconds"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Consume shipments until SIGTERM/SIGINT (or ``--duration``), then stop cleanly.

        Refuses to start (``SystemCheckError``, listing every problem) on bad settings.
        An executor owns no shards, so orphaned shards do not stop it.
        """
        run_worker_checks(self, everything=not options["skip_checks"], shards=False)
        conf = get_settings()
        url = options["broker"] or conf.BROKER_URL
        if options["threads"] < 1:
            raise CommandError("--threads must be >= 1")
        if url.startswith("memory://"):
            raise CommandError(
                "the memory:// broker only reaches consumers in the worker's own process; "
                'set DURABLE["BROKER_URL"] (or --broker) to RabbitMQ or Redis'
            )
        discover(conf)  # what registers the handlers: shipped names are only looked up
        clock = SystemClock()
        # Like the worker, stamp completions and retries by the database's clock.
        db_now = database_now_ms(conf.DATABASE)
        if db_now is not None:
            clock.offset_ms = db_now - clock.now_ms()
        executor = EmbeddedExecutor(
            url=url,
            db=conf.DATABASE,
            clock=clock,
            resolvers=kinds.resolvers(),
            threads=options["threads"],
        )
        done = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        executor.start()
        self.stdout.write(f"executor: {options['threads']} thread(s) on queue durable.executor")
        done.wait(options["duration"])
        executor.stop()
