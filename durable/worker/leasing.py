"""Shard ownership from one worker's point of view: fair share, renew, rebalance.

Each worker aims at ``ceil(shards in scope / live workers)`` leases. Above its share it
releases shards (highest numbers first) so a newcomer can take them at once; below it, it
takes free or expired leases. Taking is one conditional UPDATE per shard, so two workers
racing for the same shard cannot both win, and each win bumps the fencing token.

With Raft on (``DURABLE["RAFT"]``, :mod:`durable.raft`), a shard whose group has a leader
is owned by that leader: it takes the lease at once (:meth:`LeaseKeeper.acquire_as_leader`,
which beats an older Raft term on the row), and any other node holding it gives it up
(:meth:`LeaseKeeper.not_leader`). Only shards whose group has no quorum follow the rules
above (the fallback), so Raft never makes the cluster less available than the leases.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from durable.storage import leases as store
from durable.worker.logs import event

if TYPE_CHECKING:
    from durable.raft.groups import GroupSet

log = logging.getLogger("durable.worker")


@dataclass(frozen=True, slots=True)
class Acquired:
    """A lease this worker just took, with whom it took it from (for takeover logs)."""

    shard: int
    token: int
    previous_owner: str
    cursor_ms: int
    standby: tuple[tuple[int, int], ...] = ()  # Raft: the standby's timers


class LeaseKeeper:
    """Decides which shards to take and give up; the engine applies the decisions."""

    def __init__(self, *, db: str, node: str, scope: Iterable[int], ttl_s: float) -> None:
        self.db = db
        self.node = node
        self.scope = sorted(scope)
        self.ttl_s = ttl_s
        self.raft: GroupSet | None = None
        self.unloaded: dict[int, Acquired] = {}
        """Leases taken and not yet loaded into a runner (see :meth:`take_unloaded`).

        Each lease is recorded here the moment its UPDATE commits: taking a worker's share
        is a transaction per shard, and a database error partway (a terminated session)
        used to drop the list of those already taken, which then sat owned by this worker
        and served by nobody until they expired, ``LEASE_TTL_S`` later (found by the chaos
        run, seed 20261202)."""

    def fallback(self, shards: Iterable[int]) -> list[int]:
        """The shards the lease rules decide: all without Raft, else those with no quorum."""
        raft = self.raft
        if raft is None:
            return sorted(shards)
        return sorted(s for s in shards if not raft.has_quorum(s))

    def not_leader(self, held: Iterable[int]) -> list[int]:
        """Held shards whose group another node is known to lead (to give up).

        Not those merely without a leader: the node keeps firing them (fenced as ever)
        until a new leader is known, which then takes them at once; giving them up at
        every step-down only added takeovers.
        """
        raft = self.raft
        if raft is None:
            return []
        return sorted(s for s in held if raft.led_by_other(s))

    def raft_pending(self, held: Iterable[int]) -> bool:
        """True when Raft says ownership must change now (cheap: no query)."""
        raft = self.raft
        if raft is None:
            return False
        held = set(held)
        if self.not_leader(held):
            return True
        return any(raft.is_leader(s) and s not in held for s in self.scope)

    def acquire_as_leader(self, held: Iterable[int], now_ms: int) -> list[Acquired]:
        """Take every shard this node leads and does not hold, at once (see module doc)."""
        raft = self.raft
        if raft is None:
            return []
        held = set(held)
        taken: list[Acquired] = []
        terms = {s: raft.term(s) for s in self.scope if s not in held and raft.is_leader(s)}
        if not terms:
            return []
        rows = {r.shard: r for r in store.snapshot(self.db)}
        # One statement for every shard: a failover hands a node a third of the shards
        # at once, and one transaction per shard was ~70 ms each on a loaded machine.
        tokens = store.acquire_as_leader(self.db, terms, self.node, now_ms, self.ttl_s)
        locked = set(terms) - set(tokens)  # a frozen old owner may hold them: end it
        if locked and (
            pids := store.end_frozen_holders(self.db, locked, store.FROZEN_HOLDER_IDLE_S)
        ):
            event(
                log,
                logging.WARNING,
                "lease.frozen_holder_ended",
                node=self.node,
                shards=",".join(map(str, sorted(locked))),
                pids=",".join(map(str, pids)),
            )
        for shard, token in sorted(tokens.items()):
            term = terms[shard]
            row = rows.get(shard)
            previous = row.owner if row is not None else ""
            cursor = row.cursor_ms if row is not None else 0
            # All it holds (the owner replicated timers due within a minute): they fire
            # from it while the rest of the horizon is read a few buckets a turn.
            standby = tuple(raft.standby_due(shard, ahead_ms=None))
            taken.append(Acquired(shard, token, previous, cursor, standby))
            self.unloaded[shard] = taken[-1]
            event(
                log,
                logging.INFO,
                "lease.raft_takeover" if previous and previous != self.node else "lease.acquired",
                shard=shard,
                token=token,
                node=self.node,
                previous=previous or "-",
                term=term,
                standby=len(standby),
            )
        return taken

    def fair_share(self, now_ms: int, rows: list[store.LeaseRow] | None = None) -> int:
        """How many shards this worker should hold now.

        Live workers are those with a fresh heartbeat, minus those that let a lease lapse:
        a killed worker's heartbeat looks fresh for up to a TTL after its leases expired,
        and counting it would make the survivors wait that long to take its shards.
        """
        live = store.live_node_names(self.db, now_ms, self.ttl_s)
        if rows is not None:
            now = store.ms_to_dt(now_ms)
            live -= {r.owner for r in rows if r.owner and r.is_free(now)}
        live.add(self.node)
        return math.ceil(len(self.fallback(self.scope)) / len(live))

    def next_foreign_expiry_ms(self, rows: list[store.LeaseRow], now_ms: int) -> int | None:
        """When the next lease held by another worker expires (to rebalance right then)."""
        now = store.ms_to_dt(now_ms)
        times = [
            int(r.expires_at.timestamp() * 1000)
            for r in rows
            if r.owner and r.owner != self.node and r.expires_at is not None and r.expires_at > now
        ]
        return min(times) if times else None

    def renew(self, held: dict[int, int], cursors: dict[int, int], now_ms: int) -> set[int]:
        """Renew ``held``; return the shards lost since the last renewal."""
        if not held:
            return set()
        kept = store.renew(self.db, self.node, held, cursors, now_ms, self.ttl_s)
        lost = set(held) - kept
        for shard in sorted(lost):
            event(
                log, logging.WARNING, "lease.lost", shard=shard, token=held[shard], node=self.node
            )
        return lost

    def to_release(
        self, held: Iterable[int], now_ms: int, rows: list[store.LeaseRow] | None = None
    ) -> list[int]:
        """Shards above the fair share, highest numbers first."""
        held = self.fallback(held)
        extra = len(held) - self.fair_share(now_ms, rows)
        return held[::-1][:extra] if extra > 0 else []

    def acquire_up_to_share(
        self, held: Iterable[int], now_ms: int, rows: list[store.LeaseRow]
    ) -> list[Acquired]:
        """Take free or expired leases until this worker holds its fair share."""
        mine = set(held)
        held = set(self.fallback(mine))
        want = self.fair_share(now_ms, rows) - len(held)
        if want <= 0:
            return []
        now = store.ms_to_dt(now_ms)
        scope = set(self.fallback(self.scope)) - mine
        rows = [r for r in rows if r.shard in scope]
        # Cleanly released leases first: taking an expired one means a takeover.
        free = [r for r in rows if r.shard not in held and r.is_free(now)]
        free.sort(key=lambda r: (bool(r.owner), r.shard))
        taken: list[Acquired] = []
        for row in free:
            if len(taken) >= want:
                break
            token = store.acquire(self.db, row.shard, self.node, now_ms, self.ttl_s)
            if token is None:
                continue  # another worker won the race
            taken.append(Acquired(row.shard, token, row.owner, row.cursor_ms))
            self.unloaded[row.shard] = taken[-1]
            name = "lease.takeover" if row.owner and row.owner != self.node else "lease.acquired"
            event(
                log,
                logging.INFO,
                name,
                shard=row.shard,
                token=token,
                node=self.node,
                previous=row.owner or "-",
                cursor_ms=row.cursor_ms,
            )
        return taken

    def take_unloaded(self) -> list[Acquired]:
        """The leases taken and not loaded yet, oldest first; the caller loads each and
        then calls :meth:`loaded` (a failure in between keeps it for the next turn)."""
        return list(self.unloaded.values())

    def loaded(self, shard: int) -> None:
        """``shard``'s lease is served now (its runner is built): no longer unloaded."""
        self.unloaded.pop(shard, None)

    def release(self, shard: int, token: int, cursor_ms: int) -> None:
        """Give ``shard`` up cleanly."""
        if store.release(self.db, shard, self.node, token, cursor_ms):
            event(log, logging.INFO, "lease.released", shard=shard, token=token, node=self.node)
