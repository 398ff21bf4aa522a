"""The engine's lease upkeep: renew, give up, take (with Raft: as the groups decide).

A mixin of :class:`durable.worker.engine.Engine`, kept apart so each module stays small:
it uses the engine's ``keeper``, ``runners``, ``raft``, ``firer``, ``metrics`` and clock.
Renewal may also run between batches of a long turn; rebalancing (taking and giving up
shards) only at the start of a turn.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from durable.storage import leases as lease_store
from durable.worker import raftlink
from durable.worker.logs import event
from durable.worker.runner import load_acquired

HAND_AWAY_WAIT_S = 1.0
"""A stopping node with Raft on waits this long at most for its groups' new leaders
(a transfer takes a heartbeat or two) before it goes; past it, its groups elect them."""

if TYPE_CHECKING:
    from durable.worker.runner import ShardRunner

log = logging.getLogger("durable.worker")


class Ownership:
    """Lease renewal and rebalancing, mixed into the engine."""

    runners: dict[int, ShardRunner]
    keeper: Any
    lines: Any
    raft: Any
    firer: Any
    metrics: Any
    clock: Any
    conf: Any
    db: str
    node: str
    _next_renew_ms: int
    _next_rebalance_ms: int

    def _drop(self, shard: int, reason: str) -> None:
        runner = self.runners.pop(shard, None)
        if runner is not None:
            event(
                log,
                logging.WARNING,
                "lease.lost",
                shard=shard,
                token=runner.token,
                node=self.node,
                reason=reason,
            )
            self.metrics.on_lease("lost", len(self.runners))

    def _renew_if_due(self) -> None:
        """Heartbeat and renew (no rebalancing) when a renewal is due mid-turn."""
        now = self.clock.now_ms()
        if now < self._next_renew_ms:
            return
        self._next_renew_ms = now + int(self.conf.LEASE_TTL_S * 1000 / 3)
        held = {s: r.token for s, r in self.runners.items()}
        view = None if self.raft is None else raftlink.view(self.raft)
        lease_store.heartbeat(self.db, self.node, held, now, view)
        if self.raft is not None:
            self.metrics.set_raft(self.raft.status(), self.raft.leadership_changes)
        cursors = {s: r.cursor_ms for s, r in self.runners.items()}
        for shard in self.keeper.renew(held, cursors, now):
            self._drop(shard, reason="renewal found it taken over")
        self._log_busy_handlers()

    def _log_busy_handlers(self) -> None:
        """Say, once a renewal, that due external timers wait for a free handler thread.

        Parked timers give their counted attempt back and log nothing else, so a pool held
        by handlers that run long (a workflow replay has no deadline) was invisible: the
        Raft chaos run's shard-42 stall (docs/reliability.md) could not be told from it.
        """
        external = self.firer.external
        if external.parked:
            event(
                log,
                logging.WARNING,
                "worker.handlers_busy",
                node=self.node,
                parked=external.parked,
                in_flight=external.in_flight,
                threads=external.pool.size,
            )

    def _maintain_leases(self, now: int) -> None:
        self._next_rebalance_ms = now + int(self.conf.LEASE_TTL_S * 1000 / 3)
        self._next_renew_ms = 0
        self._load_unloaded(now)  # a database error cut an earlier turn's loading short
        self._renew_if_due()
        rows = lease_store.snapshot(self.db)
        foreign_expiry = self.keeper.next_foreign_expiry_ms(rows, now)
        if foreign_expiry is not None:  # a peer that stops renewing is replaced at once
            self._next_rebalance_ms = min(self._next_rebalance_ms, foreign_expiry + 50)
        # Raft: a shard led by another node is given up at once (its leader takes it with
        # a new token anyway, so an external fire in flight is fenced either way).
        for shard in self.keeper.not_leader(self.runners):
            runner = self.runners.pop(shard)
            self.keeper.release(shard, runner.token, runner.cursor_ms)
            self.metrics.on_lease("released", len(self.runners))
        if not self.firer.in_flight:  # never hand over a shard with an external fire running
            for shard in self.keeper.to_release(self.runners, now, rows):
                runner = self.runners.pop(shard)
                self.keeper.release(shard, runner.token, runner.cursor_ms)
                self.metrics.on_lease("released", len(self.runners))
        self.keeper.acquire_as_leader(self.runners, now)
        self._load_unloaded(now)
        self.keeper.acquire_up_to_share(self.runners, now, rows)
        self._load_unloaded(now)

    def _load_unloaded(self, now: int) -> None:
        """Build a runner for every lease taken and not loaded yet: this turn's, and any a
        database error cut short in an earlier turn (renewal, right after, drops it if it
        was taken meanwhile; every batch is fenced by its token anyway)."""
        for got in self.keeper.take_unloaded():
            runner = load_acquired(self.db, self.conf, got, now, raft=self.raft is not None)
            self.runners[got.shard] = runner
            self.keeper.loaded(got.shard)
            self.lines.shard_loaded(got.shard)
            self.metrics.on_rebuild(runner.rebuild_s)
            taken_over = bool(got.previous_owner) and got.previous_owner != self.node
            self.metrics.on_lease("takeover" if taken_over else "acquired", len(self.runners))

    def _wait_for_new_leaders(self, deadline: float) -> None:
        """Raft on: give the leadership transfers asked for up to ``HAND_AWAY_WAIT_S``
        (within the grace ``deadline``) to finish while this node's groups still run."""
        if self.raft is None:
            return
        until = min(deadline, time.monotonic() + HAND_AWAY_WAIT_S)
        shards = list(range(self.conf.SHARDS))
        while self.raft.leads_any(shards) and time.monotonic() < until:
            time.sleep(0.02)

    def _hand_over(self, deadline: float) -> None:
        """Stopping: wait for the external attempts in flight (until ``deadline``, a
        ``time.monotonic()`` reading), handing every other shard over meanwhile.

        With Raft on, the leadership of each shard it hands over goes to a peer first
        (:meth:`durable.raft.groups.GroupSet.hand_away`), which then takes the lease at
        once. The node is marked stopped first, so peers count it out and take at once what it
        releases: each shard with no attempt in flight goes now, each busy one as soon as
        its attempts are done. The busy ones' leases are renewed while they wait: a grace
        period longer than ``LEASE_TTL_S`` must not let them lapse, or a peer would take
        the shard, fence the handlers' completions out and run them again.
        """
        lease_store.mark_stopped(self.db, self.node, self.clock.now_ms())
        next_renew_ms = 0
        while True:
            busy = self.firer.external.busy_shards()
            if self.raft is not None:  # the peers lead them next: no election to wait for
                self.raft.hand_away([s for s in range(self.conf.SHARDS) if s not in busy])
            for shard in sorted(set(self.runners) - busy):
                runner = self.runners.pop(shard)
                self.keeper.release(shard, runner.token, runner.cursor_ms)
                self.metrics.on_lease("released", len(self.runners))
            if not self.firer.in_flight or time.monotonic() >= deadline:
                self._wait_for_new_leaders(deadline)
                return
            now = self.clock.now_ms()
            if now >= next_renew_ms:  # no heartbeat: that would count the node in again
                next_renew_ms = now + int(self.conf.LEASE_TTL_S * 1000 / 3)
                held = {s: r.token for s, r in self.runners.items()}
                cursors = {s: r.cursor_ms for s, r in self.runners.items()}
                for shard in self.keeper.renew(held, cursors, now):
                    self._drop(shard, reason="renewal found it taken over")
            time.sleep(0.05)
