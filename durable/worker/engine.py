"""The ``run_timer_shards`` engine: one loop that owns shards and fires their timers.

Each turn of the loop: maintenance when due (heartbeat, lease renewal and rebalancing,
loading buckets that entered the horizon, rescans, clock-offset measurement, pruning),
then every owned shard's wheel is advanced to now and its due ids fired in fenced
batches, then the loop sleeps until the nearest wheel deadline or maintenance time, or
until a NOTIFY arrives. :meth:`Engine.tick` is one turn without the sleep, which is what
tests drive with a manual clock.

A database error anywhere ends the turn: the engine drops its connections, waits with
backoff, and on the next turn renews (dropping any shard it lost) and rescans everything
due, so nothing is lost; fencing and row states make sure nothing fires twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.db.backends.signals import connection_created

from durable.conf import DurableSettings, get_settings
from durable.core.clock import Clock, SystemClock
from durable.discovery import discover
from durable.dispatch import kinds
from durable.dispatch.executors import EmbeddedExecutor
from durable.dispatch.registry import HandlerRegistry, handlers
from durable.metrics import WorkerMetrics
from durable.scheduling.cron import sync_declared
from durable.storage import leases as lease_store
from durable.storage import statements, timeline
from durable.worker import housekeeping, raftlink
from durable.worker.batches import BatchOutcome, in_turn_order, pack, put_back
from durable.worker.chores import Chores
from durable.worker.firer import Firer
from durable.worker.leasing import LeaseKeeper
from durable.worker.lines import LineKeeper
from durable.worker.listener import Listener, sort_notices
from durable.worker.logs import event
from durable.worker.outcomes import Readd
from durable.worker.ownership import Ownership
from durable.worker.pool import HandlerPool
from durable.worker.runner import ShardRunner

log = logging.getLogger("durable.worker")

MAX_SLEEP_S = 1.0
RAFT_WAKE_S = 0.1
TURN_BUDGET_MS = 500
"""Most time one turn spends firing (after its first batch, and one counted ahead then:
durable.worker.ahead): the rest of a backlog goes back to the wheels for the next turns.
Lease and Raft changes, warm takeovers' rebuilds and the timers newly due wait for a
turn's end: a turn that fired a whole backlog of tens of thousands ran for a minute
after a Raft takeover (issue 17's rolling restart)."""


@dataclass(slots=True)
class Stats:
    """Running totals, read by metrics and by tests."""

    fired: int = 0
    errors: int = 0
    lateness_ms: list[int] = field(default_factory=list)
    keep_lateness: bool = False


class Engine(Ownership):
    """Owns shard leases and fires their timers; see the module docstring."""

    def __init__(
        self,
        *,
        node: str | None = None,
        clock: Clock | None = None,
        conf: DurableSettings | None = None,
        scope: list[int] | None = None,
        threads: int = 4,
        registry: HandlerRegistry = handlers,
        metrics: WorkerMetrics | None = None,
        raft_self: str | None = None,
        raft_bind: str | None = None,
        pool: HandlerPool | None = None,
    ) -> None:
        self.conf = conf or get_settings()
        self.db = self.conf.DATABASE
        self.node = node or f"{socket.gethostname()}-{os.getpid()}"
        self.clock = clock or SystemClock()
        self.stop_event = threading.Event()
        self.inbox: queue.SimpleQueue[Readd] = queue.SimpleQueue()
        self.metrics = metrics or WorkerMetrics()
        # Threads for external handlers (and the engine's own background reads); tests may
        # pass a pool that runs them on the calling thread (durable.testing.time_machine).
        self.executor = pool or HandlerPool(threads, name="durable")
        self.firer = Firer(
            db=self.db,
            conf=self.conf,
            clock=self.clock,
            registry=registry,
            pool=self.executor,
            inbox=self.inbox,
            resolvers={**kinds.resolvers(), "handler": registry.resolve},
            metrics=self.metrics,
        )
        self.keeper = LeaseKeeper(
            db=self.db,
            node=self.node,
            scope=scope if scope is not None else range(self.conf.SHARDS),
            ttl_s=self.conf.LEASE_TTL_S,
        )
        # Raft beside the leases (None: off): see durable.worker.leasing and raftlink.
        self.raft = raftlink.build(self.conf, self.clock, self.keeper.scope, raft_self, raft_bind)
        self.keeper.raft = self.raft
        # Behind a transaction-mode pooler, LISTEN needs a direct session (LISTEN_DATABASE).
        self.listener = Listener(self.conf.LISTEN_DATABASE or self.db, self.stop_event)
        # DISPATCH = "kombu" on memory:// reaches no other process: execute in this one.
        self.embedded: EmbeddedExecutor | None = None
        if self.conf.DISPATCH == "kombu" and self.conf.BROKER_URL.startswith("memory://"):
            self.embedded = EmbeddedExecutor(
                url=self.conf.BROKER_URL,
                db=self.db,
                clock=self.clock,
                resolvers=self.firer.resolvers,
                threads=threads,
            )
        self.runners: dict[int, ShardRunner] = {}
        self.stats = Stats()
        self.chores = Chores(
            db=self.db,
            conf=self.conf,
            node=self.node,
            clock=self.clock,
            pool=self.executor,
            metrics=self.metrics,
            runners=lambda: self.runners,
        )
        # Wakes lines a deploy or a lost wake left waiting (see durable.worker.lines).
        self.lines = LineKeeper(db=self.db, conf=self.conf, lookup=registry.get)
        # Renewal may also run between batches of a long turn; rebalancing (taking and
        # giving up shards) only at the start of a turn. Separate deadlines, so busy
        # firing, which renews often, never starves rebalancing.
        self._next_renew_ms = 0
        self._next_rebalance_ms = 0
        self._started = False
        self._first_shard = 0  # where the next turn starts firing (see in_turn_order)
        self._loop_thread = threading.get_ident()

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Import what registers handlers, register this node, create missing lease rows."""
        # Before anything fires: at fire time names are only looked up, never imported.
        modules = discover(self.conf)
        event(log, logging.INFO, "worker.discovered", node=self.node, modules=",".join(modules))
        self.chores.measure_offset()
        if self.embedded is not None:
            self.embedded.start()
        now = self.clock.now_ms()
        lease_store.ensure_shards(self.db, self.conf.SHARDS)
        lease_store.register_node(self.db, self.node, socket.gethostname(), os.getpid(), now)
        # Declared schedules (@durable.cron, DURABLE["CRONS"]) become rows with a pending
        # first occurrence; idempotent, and safe when several workers start at once.
        report = sync_declared(self.db, now)
        event(log, logging.INFO, "schedules.synced", node=self.node, report=str(report))
        self._loop_thread = threading.get_ident()
        if self.raft is not None:
            self.raft.start()
        connection_created.connect(self._guard_connection)
        if connections[self.db].connection is not None:
            self._guard_connection(sender=None, connection=connections[self.db])
        event(
            log,
            logging.INFO,
            "worker.started",
            node=self.node,
            shards=self.conf.SHARDS,
            db=connections[self.db].vendor,
        )
        self._started = True

    def _guard_connection(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        """Guard this loop's own PostgreSQL session (see ``housekeeping.guard_session``);
        let every worker connection to ``DATABASE`` prepare (``statements.prepare_on``);
        refuse a server on a stale timeline (``durable.storage.timeline``)."""
        if connection.alias != self.db:
            return
        timeline.check(connection)  # an old primary that came back is refused
        if statements.should_prepare(self.conf):
            statements.prepare_on(connection)
        if threading.get_ident() == self._loop_thread:
            housekeeping.guard_session(connection, self.conf)

    def run(self, duration_s: float | None = None) -> None:
        """Loop until :meth:`stop` (or ``duration_s``), then shut down cleanly."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        backoff = 0.2
        while not self.stop_event.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            try:
                if not self._started:
                    self.start()
                self.tick()
                self._sleep()
                backoff = 0.2
            except (OperationalError, InterfaceError) as exc:
                self._on_database_error(exc, backoff)
                backoff = min(backoff * 2, 5.0)
        self.shutdown()

    def stop(self) -> None:
        """Ask the loop to finish its turn and shut down (safe from signal handlers)."""
        self.stop_event.set()

    def shutdown(self, wait_s: float | None = None) -> None:
        """Finish in-flight external handlers (up to ``SHUTDOWN_GRACE_S``), release leases,
        mark stopped. Meanwhile every shard with no handler in flight is handed over at
        once (see ``Ownership._hand_over``). Handlers still running then are left to their
        daemon threads: the shards' next owners re-run their claims at once."""
        grace = self.conf.SHUTDOWN_GRACE_S if wait_s is None else wait_s
        deadline = time.monotonic() + grace
        try:
            self._hand_over(deadline)
        except DatabaseError as exc:  # the database is away: wait, then release what we can
            event(log, logging.WARNING, "worker.release_failed", node=self.node, error=exc)
        while self.firer.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.firer.ahead.close()
        if self.embedded is not None:
            self.embedded.stop()
        self._drain_inbox()
        try:
            for shard in sorted(self.runners):
                runner = self.runners.pop(shard)
                self.keeper.release(shard, runner.token, runner.cursor_ms)
            for got in self.keeper.take_unloaded():  # taken, never served: free them too
                self.keeper.release(got.shard, got.token, got.cursor_ms)
                self.keeper.loaded(got.shard)
            lease_store.mark_stopped(self.db, self.node, self.clock.now_ms())
        except DatabaseError as exc:
            event(log, logging.WARNING, "worker.release_failed", node=self.node, error=exc)
        self.listener.close()
        if self.raft is not None:
            self.raft.stop()
        connection_created.disconnect(self._guard_connection)
        housekeeping.unguard_session(connections[self.db])
        event(log, logging.INFO, "worker.stopped", node=self.node)

    # -- one turn ------------------------------------------------------------------------

    def tick(self) -> int:
        """Run maintenance that is due, then fire everything due now; return fires."""
        now = self.clock.now_ms()
        self._drain_inbox()
        self.firer.external.reap()  # external handlers past their deadline
        for shard, timer_id, fire_at in self.firer.external.unpark():  # threads freed
            runner = self.runners.get(shard)
            if runner is not None:
                runner.add(timer_id, fire_at)
        if now >= self._next_rebalance_ms or self.keeper.raft_pending(self.runners):
            self._maintain_leases(now)
        self.chores.before_firing(now)
        paced = False  # a warm takeover's horizon: one shard's few buckets a turn
        for runner in list(self.runners.values()):
            if not (runner.paced and paced):
                paced |= runner.paced
                runner.load_ahead(now)
        fired = self._fire_due()
        # Rescans come after the fires, so a timer announced by NOTIFY does not wait
        # behind a shard's rescan; what a rescan finds due is fired in this turn still.
        found = 0
        for runner in list(self.runners.values()):
            if now >= runner.next_rescan_ms:
                found += runner.rescan(now)
        # Lines left waiting (a limit changed, a wake lost): at a shard's load, then
        # every minute; the timers it makes due fire in this turn still.
        if self.lines.due(now):
            found += self.lines.run(self.runners, now)
        if found:
            fired += self._fire_due()
        if self.raft is not None:
            raftlink.flush(self.raft, self.node, self.runners, now)
        self.chores.after_firing(now)
        return fired

    def _fire_due(self) -> int:
        now = self.clock.now_ms()
        order = in_turn_order(self.runners.values(), self._first_shard)
        work = [(runner, runner.due(now)) for runner in order]
        behind: set[int] = set()  # shards with due timers left for the next turn
        fired = 0
        batches = pack(work, self.conf.BATCH_SIZE)
        for index, batch in enumerate(batches):
            stopping = self.stop_event.is_set()
            spent = bool(index) and self.clock.now_ms() - now >= TURN_BUDGET_MS
            if stopping or (spent and not self.firer.ahead.pending):  # counted: it runs
                # Stopping (SIGTERM): no new batch, or a backlog of many would hold the
                # exit back. The rest stays pending for the shards' next owners, and
                # their cursors stay before it (they catch it up as a backlog). Budget
                # spent: the rest goes back to the wheels, due first in the next turn.
                behind.update(runner.shard for later in batches[index:] for runner, _ in later)
                self.firer.ahead.drop()  # counted ahead, not to run now
                if not stopping:
                    put_back(batches[index:], now)
                    self._first_shard = batches[index - 1][-1][0].shard + 1
                break
            # Renew between batches, with no count in flight (durable.worker.ahead).
            self.firer.ahead.wait()
            self._renew_if_due()
            # Shards lost meanwhile are left out; the new owner rebuilds from the rows.
            more = [] if spent else batches[index + 1 : index + 2]  # counted meanwhile
            batch, *ahead = ([(r, i) for r, i in b if self._owns(r)] for b in [batch, *more])
            for shard, outcome in self.firer.fire(batch, *ahead).items():
                if outcome.lost:
                    self._drop(shard, reason=outcome.lost)
                    continue
                fired += len(outcome.fired)
                if outcome.leftover:
                    behind.add(shard)
                self._record_batch(shard, outcome)
        for runner, _ in work:
            if runner.shard not in behind and self._owns(runner):
                runner.cursor_ms = now
        self.stats.fired += fired
        return fired

    def _owns(self, runner: ShardRunner) -> bool:
        return self.runners.get(runner.shard) is runner

    def _record_batch(self, shard: int, outcome: BatchOutcome) -> None:
        self.stats.errors += len(outcome.errors)
        self.metrics.on_batch(shard, len(outcome.fired), outcome.lateness_ms, len(outcome.errors))
        if self.stats.keep_lateness:
            self.stats.lateness_ms.extend(outcome.lateness_ms)

    def _sleep(self) -> None:
        now = self.clock.now_ms()
        wake = [self._next_rebalance_ms, self.chores.next_due_ms()]
        for runner in self.runners.values():
            wake.append(runner.next_rescan_ms)
            nxt = runner.next_wakeup_ms()
            if nxt is not None:
                wake.append(nxt)
        # Raft: wake often enough to act on a leadership change within RAFT_WAKE_S.
        top = MAX_SLEEP_S if self.raft is None else RAFT_WAKE_S
        timeout = min(top, max(0.0, (min(wake) - now) / 1000))
        external = self.firer.external
        if not self.inbox.empty() or (external.parked and external.free):
            timeout = 0.0
        elif external.parked:
            # Saturated: wake the moment a handler thread frees (notices queue meanwhile,
            # and are read at once after).
            external.freed.wait(timeout)
            timeout = 0.0
        external.freed.clear()
        rescans, overflowed, timers = sort_notices(self.listener.wait(timeout), self.runners)
        for shard in sorted(rescans):  # one rescan per shard, however often it was asked
            self.runners[shard].rescan(self.clock.now_ms())
        for shard in overflowed:  # rescanned in the next turn, after its fires
            self.runners[shard].next_rescan_ms = 0
        for notice in timers:
            assert notice.timer_id is not None and notice.fire_at_ms is not None
            self.runners[notice.shard].add(notice.timer_id, notice.fire_at_ms)

    def _drain_inbox(self) -> None:
        while True:
            try:
                shard, timer_id, fire_at = self.inbox.get_nowait()
            except queue.Empty:
                return
            runner = self.runners.get(shard)
            if runner is not None:
                runner.add(timer_id, fire_at)

    def _on_database_error(self, exc: Exception, backoff: float) -> None:
        stale = isinstance(exc, timeline.StalePrimaryError)
        event(
            log,
            logging.ERROR if stale else logging.WARNING,
            "database.stale_primary" if stale else "database.unavailable",
            node=self.node,
            retry_in_s=backoff,
            error=str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
        )
        with contextlib.suppress(Exception):  # an already-broken connection may refuse
            connections[self.db].close()
        self.listener.close()
        self.stop_event.wait(backoff)
        # Renew at once on the next turn (dropping lost shards) and rescan what is due.
        self._next_rebalance_ms = 0
        for runner in self.runners.values():
            runner.next_rescan_ms = 0
