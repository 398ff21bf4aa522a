"""``python manage.py run_timer_shards``: the durable worker; run one per node."""

from __future__ import annotations

import gc
import os
import signal
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from durable.checks import run_worker_checks
from durable.conf import get_settings
from durable.metrics import MetricsPortInUse, WorkerMetrics
from durable.worker.engine import Engine


def parse_shards(spec: str, total: int) -> list[int]:
    """Parse ``"0-15,32,40-47"`` into shard numbers, each in ``[0, total)``."""
    shards: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise CommandError(f"--shards: {part!r} is not a number or a range") from None
        if not 0 <= first <= last < total:
            raise CommandError(f"--shards: {part!r} is outside 0-{total - 1}")
        shards.update(range(first, last + 1))
    return sorted(shards)


class Command(BaseCommand):
    help = "Own shard leases and fire durable timers (one per node; SIGTERM stops cleanly)."
    # Checks run in handle() instead (as migrate does), so they can be given the database:
    # Django's default ("__all__") runs them without one, which skips the shard checks.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--skip-checks",
            action="store_true",
            help="skip the project's system checks (durable's own checks always run)",
        )
        parser.add_argument(
            "--node",
            default=os.environ.get("DURABLE_NODE"),
            help="unique worker name (default: DURABLE_NODE or host-pid)",
        )
        parser.add_argument(
            "--shards", default=None, help="only these shards, e.g. 0-15,32 (default: all)"
        )
        parser.add_argument(
            "--threads",
            type=int,
            default=4,
            help="executor threads for external (atomic=False) handlers",
        )
        parser.add_argument(
            "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port"
        )
        parser.add_argument(
            "--metrics-host",
            default="127.0.0.1",
            help="address for --metrics-port (loopback by default; 0.0.0.0 exposes it)",
        )
        parser.add_argument(
            "--duration", type=float, default=None, help="stop cleanly after this many seconds"
        )
        parser.add_argument(
            "--raft-self",
            default=None,
            help="with DURABLE['RAFT']: this node's base address host:port (overrides SELF; "
            "the peers are PEERS plus SELF minus this one)",
        )
        parser.add_argument(
            "--raft-bind",
            default=None,
            help="with DURABLE['RAFT']: where this node listens and connects from, "
            "host:port (overrides BIND; default: the node's own address)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run the worker until SIGTERM/SIGINT (or ``--duration``).

        Refuses to start (``SystemCheckError``, listing every problem) on bad settings or
        orphaned shards: durable's checks run first, whatever ``--skip-checks`` says.
        """
        run_worker_checks(self, everything=not options["skip_checks"], shards=True)
        conf = get_settings()
        scope = None
        if options["shards"]:
            scope = parse_shards(options["shards"], conf.SHARDS)
        if options["threads"] < 1:
            raise CommandError("--threads must be >= 1")
        metrics = WorkerMetrics()
        if options["metrics_port"] is not None:
            self.serve_metrics(metrics, options["metrics_port"], options["metrics_host"])
        from durable.raft.config import RaftConfigError

        if conf.RAFT is None and (options["raft_self"] or options["raft_bind"]):
            raise CommandError("--raft-self/--raft-bind need DURABLE['RAFT'] to be set")
        try:
            engine = Engine(
                node=options["node"],
                scope=scope,
                threads=options["threads"],
                metrics=metrics,
                raft_self=options["raft_self"],
                raft_bind=options["raft_bind"],
            )
        except RaftConfigError as exc:
            raise CommandError(str(exc)) from None

        def on_signal(signum: int, frame: Any) -> None:
            # The first signal stops cleanly: running handlers get SHUTDOWN_GRACE_S to
            # finish. A second one exits at once; the leases then expire, and the next
            # owners re-run this worker's claims.
            if engine.stop_event.is_set():
                self.stderr.write("second signal: exiting at once")
                os._exit(1)
            engine.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        # Everything loaded so far (Django, the app's modules) lives as long as the
        # process: keep the cyclic garbage collector from scanning it again and again.
        # Full collections over it took 35-50 ms with 10,000 runs asleep, every few
        # seconds, and showed as the p99 of wake-up lateness (docs/benchmarks.md).
        gc.freeze()
        shards = options["shards"] or f"0-{conf.SHARDS - 1}"
        self.stdout.write(
            f"durable worker {engine.node} started: shards {shards} of {conf.SHARDS}, "
            f"{options['threads']} handler threads, database {conf.DATABASE!r} "
            "(Ctrl-C stops cleanly)"
        )
        from durable.raft.groups import RaftBindError

        try:
            engine.run(duration_s=options["duration"])
        except RaftBindError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"durable worker {engine.node} stopped")

    def serve_metrics(self, metrics: WorkerMetrics, port: int, host: str) -> None:
        """Serve ``/metrics`` before the worker starts; a port it cannot bind stops it
        with a :class:`CommandError` that says why (not a traceback)."""
        if not 1 <= port <= 65535:
            raise CommandError(f"--metrics-port: {port} is not a port number (1..65535)")
        try:
            metrics.serve(port, host=host)
        except MetricsPortInUse:
            raise CommandError(
                f"--metrics-port: port {port} is in use on {host} (is another worker "
                "running on this node? give each its own port)"
            ) from None
        except OSError as exc:
            raise CommandError(
                f"--metrics-port/--metrics-host: cannot serve metrics on {host}:{port}: "
                f"{exc.strerror or exc}"
            ) from None
        self.stdout.write(f"metrics on http://{host}:{port}/metrics")
