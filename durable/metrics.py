"""Prometheus metrics of the worker, served on ``--metrics-port`` (loopback by default).

Each :class:`WorkerMetrics` has its own ``CollectorRegistry`` (no process-global state),
so tests can build several engines in one process. The web side uses django-prometheus
for request metrics; this module is only the worker's view: fires, lateness, wheel depth,
database backlog, leases, errors and rebuilds.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Lateness buckets in seconds: the interesting range is 1 ms .. 10 s.
LATENESS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60)


class WorkerMetrics:
    """The worker's metrics; the engine calls the ``on_*`` methods as things happen."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.fired = Counter("durable_timers_fired", "Timers fired", ["shard"], registry=r)
        self.lateness = Histogram(
            "durable_fire_lateness_seconds",
            "Fire time minus due time",
            ["shard"],
            buckets=LATENESS_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "durable_handler_errors",
            "Handler exceptions (each schedules a retry or a dead letter)",
            ["shard"],
            registry=r,
        )
        self.dead_letters = Counter(
            "durable_timers_dead_lettered",
            "Timers that used up their attempts",
            ["shard"],
            registry=r,
        )
        self.locked_skipped = Counter(
            "durable_timers_locked_skipped",
            "Due timers left out of a batch because another session held their row locked "
            "(retried shortly)",
            ["shard"],
            registry=r,
        )
        self.wheel_depth = Gauge(
            "durable_wheel_pending", "Timers in the in-memory wheel", ["shard", "level"], registry=r
        )
        self.db_pending = Gauge(
            "durable_db_pending", "Pending timers in the database (sampled)", ["shard"], registry=r
        )
        self.lease_changes = Counter("durable_lease_changes", "Lease events", ["event"], registry=r)
        self.shards_held = Gauge("durable_shards_held", "Shards this worker holds", registry=r)
        self.rebuild = Histogram(
            "durable_shard_rebuild_seconds",
            "Time to load a shard after acquiring it",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 3, 5, 10, 30),
            registry=r,
        )
        self.workflow_runs = Gauge(
            "durable_workflow_runs", "Workflow runs by state (sampled)", ["state"], registry=r
        )
        self.step_duration = Histogram(
            "durable_workflow_step_seconds", "Duration of workflow steps", ["kind"], registry=r
        )
        # Raft on (DURABLE["RAFT"]): this node's view of each shard's group.
        self.raft_role = Gauge(
            "durable_raft_leader",
            "1 when this node is the shard's Raft leader, else 0",
            ["shard"],
            registry=r,
        )
        self.raft_term = Gauge("durable_raft_term", "Raft term per shard", ["shard"], registry=r)
        self.raft_lag = Gauge(
            "durable_raft_replication_lag_seconds",
            "Time from the owner queueing a batch to this node applying it (last batch)",
            ["shard"],
            registry=r,
        )
        self.raft_leader_changes = Counter(
            "durable_raft_leadership_changes",
            "Leaderships this node saw change (all shards)",
            registry=r,
        )

    def on_batch(self, shard: int, fired: int, lateness_ms: Iterable[int], errors: int) -> None:
        """Record one fired batch."""
        label = str(shard)
        if fired:
            self.fired.labels(label).inc(fired)
        hist = self.lateness.labels(label)
        for late in lateness_ms:
            hist.observe(max(late, 0) / 1000)
        if errors:
            self.errors.labels(label).inc(errors)

    def on_handler_error(self, shard: int) -> None:
        """Record one failed attempt of a handler that ran outside a batch (external, task)."""
        self.errors.labels(str(shard)).inc()

    def on_dead_letter(self, shard: int) -> None:
        """Record a timer moved to the dead letter."""
        self.dead_letters.labels(str(shard)).inc()

    def on_locked_skipped(self, shard: int, timers: int) -> None:
        """Record due timers a batch left out: another session held their rows locked."""
        self.locked_skipped.labels(str(shard)).inc(timers)

    def on_lease(self, event: str, held: int) -> None:
        """Record a lease event (acquired, takeover, released, lost)."""
        self.lease_changes.labels(event).inc()
        self.shards_held.set(held)

    def on_rebuild(self, seconds: float) -> None:
        """Record how long loading a shard took."""
        self.rebuild.observe(seconds)

    def set_raft(self, view: dict[int, dict[str, Any]], changes: int) -> None:
        """Set the Raft gauges from :meth:`durable.raft.groups.GroupSet.status`; ``changes``
        is the sidecar's running count of leadership changes."""
        for shard, row in view.items():
            label = str(shard)
            self.raft_role.labels(label).set(1 if row["role"] == "leader" else 0)
            self.raft_term.labels(label).set(row["term"])
            self.raft_lag.labels(label).set(row["lag_ms"] / 1000)
        seen = self.raft_leader_changes._value.get()
        if changes > seen:
            self.raft_leader_changes.inc(changes - seen)

    def set_wheel_depths(self, depths: dict[int, tuple[int, ...]]) -> None:
        """Set the wheel gauges from ``{shard: pending per level}``."""
        self.wheel_depth.clear()
        for shard, levels in depths.items():
            for level, count in enumerate(levels):
                self.wheel_depth.labels(str(shard), str(level)).set(count)

    def set_db_pending(self, counts: dict[int, int]) -> None:
        """Set the sampled pending-in-database gauges."""
        self.db_pending.clear()
        for shard, count in counts.items():
            self.db_pending.labels(str(shard)).set(count)

    def set_workflow_runs(self, counts: dict[str, int]) -> None:
        """Set the sampled workflow-runs-by-state gauges."""
        for state, count in counts.items():
            self.workflow_runs.labels(state).set(count)

    def serve(self, port: int, host: str = "127.0.0.1") -> Any:
        """Serve ``/metrics`` over HTTP on ``host:port`` in a daemon thread.

        ``port`` 0 takes any free port. Raises ``ValueError`` for a port outside
        0..65535 and :class:`MetricsPortInUse` when another socket holds it; any
        other ``OSError`` (an address this host does not have, a privileged port) passes
        through.
        """
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port: expected an integer in 0..65535, got {port!r}")
        try:
            return start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortInUse(port, host) from exc
            raise


class MetricsPortInUse(OSError):
    """The metrics port is already bound by another socket (``errno.EADDRINUSE``)."""

    def __init__(self, port: int, host: str) -> None:
        super().__init__(errno.EADDRINUSE, f"port {port} is in use on {host}")
        self.port = port
        self.host = host
