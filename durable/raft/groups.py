"""One pysyncobj Raft group per shard, all ticked by one sidecar thread per node.

DESIGN §5a says "each ticking in its own sidecar thread". Measured (pysyncobj 0.3.17, 64
groups, 3 processes on loopback, password set): 64 auto-ticking threads, each in its own
``select`` loop, cost 18-29 % of a core per idle process; one thread calling every group's
``doTick(0)`` in turn costs 15-19 % at a 50 ms tick (docs: worker reference). So this node
runs one sidecar thread, beside the worker's loop and never in it, that ticks its groups
and drains their replication queues. The groups share one poller
(:mod:`durable.raft.polling`): the sidecar sleeps in one ``poll`` over all their sockets
between turns and reads each message as it arrives; they share nothing else.

pysyncobj is imported only when a :class:`GroupSet` is built: with Raft off, none loads.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from durable.raft import standby
from durable.raft.config import RaftBindError, RaftConfig, check_bindable, election_window
from durable.raft.polling import restart_election_timer_while_alone, transfer_leadership_away
from durable.raft.state import MAX_COMMAND_ENTRIES, Handed, ShardState, shape
from durable.worker.logs import event

log = logging.getLogger("durable.raft")

DRAIN_PER_S = 100_000
"""Most timer entries the sidecar appends a second (5,000 per tick at the default 50 ms
tick), so replicating a big rebuild never crowds out the fire path for the interpreter.
A fire is two entries (the fired timer out, a new one in): 50,000 fires a second.
``bench/raft_replication.py``: at 2,000 per tick, 20,000 fires a second from one leader
filled the budget and the lag grew without bound (p99 16 s over 20 s)."""

BALANCE_STEP = 8
"""Most leaderships one balancing round hands over."""


@dataclass(slots=True)
class Group:
    """One shard's group on this node, as the sidecar sees it."""

    shard: int
    syncobj: Any
    consumer: Any
    outbox: queue.SimpleQueue[dict[str, Any] | Handed] = field(default_factory=queue.SimpleQueue)
    leader: str | None = None  # base address of the last known leader
    leader_seen: float = 0.0  # monotonic time a leader was last known
    changes: int = 0
    met_peers: bool = False  # connected to a peer at least once since start


class GroupSet:
    """This node's Raft groups and their sidecar thread; the worker's interface to Raft."""

    def __init__(
        self, config: RaftConfig, shards: range | list[int], now_ms: Callable[[], int]
    ) -> None:
        self.config = config
        self.shards = list(shards)
        self.now_ms = now_ms
        self.groups: dict[int, Group] = {}
        self.stop_event = threading.Event()
        self.changed = threading.Event()  # set on a leadership change; the worker clears it
        self.leadership_changes = 0
        self._thread: threading.Thread | None = None
        self._stable_since = time.monotonic()
        self._next_balance = time.monotonic() + config.balance_s
        self._drain_from = 0
        # Shards whose leadership goes: to these peers (None: any, spread) until then
        # (monotonic); see hand_away and _balance.
        self._handing_away: dict[int, tuple[str | None, float]] = {}
        self._handing_lock = threading.Lock()

    # -- life cycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Build every group (binding its port) and start the sidecar thread."""
        import pysyncobj.syncobj as syncobj_module
        from pysyncobj import SyncObj, SyncObjConf, SyncObjException

        from durable.raft.transport import transport_class

        # pysyncobj derives the Fernet key with 100,000 PBKDF2 rounds per group: the same
        # key 64 times over was 3 s of CPU at start-up. Same input, same key: derive once.
        if not hasattr(syncobj_module.getEncryptor, "cache_info"):
            syncobj_module.getEncryptor = functools.lru_cache(maxsize=4)(
                syncobj_module.getEncryptor
            )
        from durable.raft.polling import groups_share, shared_poller

        consumer_class = standby.consumer_class()
        self.poller = shared_poller()
        c = self.config
        for shard in self.shards:
            check_bindable(c.group_address(c.bind, shard), shard)
        for shard in self.shards:
            low, high = election_window(c, shard)
            conf = SyncObjConf(
                password=c.password,
                bindAddress=c.group_address(c.bind, shard),
                autoTick=False,  # the sidecar ticks (see the module docstring)
                useFork=False,  # never fork a multi-threaded worker (log compaction)
                appendEntriesPeriod=c.heartbeat_s,
                raftMinTimeout=low,
                raftMaxTimeout=high,
                # A leader cut off from its peers steps down after this. Not shorter:
                # at one election timeout, a loaded machine (a late tick or two) made
                # healthy leaders step down in bulk, and every step-down is a takeover.
                leaderFallbackTimeout=max(2.0, 2 * c.election_max_s),
                connectionRetryTime=max(c.heartbeat_s * 2, 0.2),
                connectionTimeout=max(c.election_max_s, 1.0),
                # The journal lives in memory: what it loses, the rows still have.
                journalFile=None,
                fullDumpFile=None,
                # pysyncobj without autoTick retries a failed bind in a busy loop for
                # ever (maxBindRetries 0): give up after ~5 s with a clear error.
                bindRetryTime=0.2,
                maxBindRetries=25,
            )
            consumer = consumer_class(shard, self.now_ms)
            try:
                with groups_share(self.poller):  # one poll(2) for every group: see _run
                    syncobj = SyncObj(
                        c.group_address(c.self_addr, shard),
                        [c.group_address(p, shard) for p in c.peers],
                        conf,
                        consumers=[consumer],
                        transportClass=transport_class(c.bind_host, shard),
                    )
            except SyncObjException as exc:
                self.stop()
                address = c.group_address(c.bind, shard)
                raise RaftBindError(
                    f"Raft: cannot listen on {address} (shard {shard}'s group): is the port "
                    "in use, or the host not one of this machine's addresses? "
                    "(DURABLE['RAFT']['BIND'] / --raft-bind)"
                ) from exc
            self.groups[shard] = Group(shard, syncobj, consumer)
        # The first election timeout counts as "a leader was known": a node just started
        # waits that long for its groups to elect before the lease rules take shards
        # (else every start took shards by the lease rules, then handed them over).
        started = time.monotonic()
        for group in self.groups.values():
            group.leader_seen = started
        self._thread = threading.Thread(target=self._run, name="durable-raft", daemon=True)
        self._thread.start()
        event(
            log,
            logging.INFO,
            "raft.started",
            self_addr=c.self_addr,
            bind=c.bind,
            peers=",".join(c.peers),
            groups=len(self.groups),
            tick_s=c.tick_s,
        )

    def stop(self) -> None:
        """Stop the sidecar and close every group's sockets."""
        self.stop_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for group in self.groups.values():
            group.syncobj._destroy()

    # -- the sidecar ---------------------------------------------------------------------

    def _run(self) -> None:
        # Between turns the sidecar sleeps in the shared poller (GIL released), reading
        # each message as it arrives; a turn (every group's timers: elections, heartbeats,
        # commits; the outboxes) runs once per tick. Before, it slept blind and polled
        # the 64 groups' sockets one by one each turn.
        tick = self.config.tick_s
        next_turn = time.monotonic()
        while not self.stop_event.is_set():
            try:
                now = time.monotonic()
                if now >= next_turn:
                    self._turn(now)
                    next_turn = max(next_turn + tick, now)
                self.poller.poll(max(0.0, next_turn - time.monotonic()))
            except Exception as exc:  # the sidecar must outlive any one bad turn
                event(log, logging.ERROR, "raft.sidecar_error", error=repr(exc))
                self.stop_event.wait(tick)

    def _turn(self, now: float) -> None:
        budget = [max(1, int(DRAIN_PER_S * self.config.tick_s))]
        # Drained from a different group each turn: a full budget is shared, not spent
        # by the first groups on every turn while the last ones' outboxes grow.
        self._drain_from = (self._drain_from + 1) % max(1, len(self.groups))
        order = list(self.groups.values())
        for group in order[self._drain_from :] + order[: self._drain_from]:
            if not group.met_peers:  # start-up only: see the function
                group.met_peers = not restart_election_timer_while_alone(group.syncobj, now)
            group.syncobj.doTick(0.0)
            if group.shard in self._handing_away:
                self._transfer_away(group, now)
            else:
                self._drain(group, budget)
            self._observe(group, now)
        if self.config.balance_s and now >= self._next_balance:
            self._next_balance = now + self.config.balance_s
            self._balance(now)

    def _drain(self, group: Group, budget: list[int]) -> None:
        # At most DRAIN_PER_S entries a second over all groups: replicating a rebuild
        # of tens of thousands of timers at once held the GIL the fire path needs.
        while budget[0] > 0:
            try:
                batch = group.outbox.get_nowait()
            except queue.Empty:
                return
            if not group.syncobj._isLeader():  # a node that lost leadership drops its news
                continue
            term = int(group.syncobj.raftCurrentTerm)
            batches = shape(batch, term) if isinstance(batch, Handed) else [batch]
            for one in batches:
                group.consumer.apply(one)
                budget[0] -= 1 + len(one["add"]) + len(one["remove"])

    def _transfer_away(self, group: Group, now: float) -> None:
        # Its news is not drained meanwhile: pysyncobj transfers only to a follower caught
        # up with the log, never the case under a steady load (refused every time).
        target, until = self._handing_away[group.shard]
        shard = group.shard
        names = self.config.peers if target is None else [target]
        peers = [self.config.group_address(p, shard) for p in names]
        first = shard % len(peers) if peers else 0  # spread over the peers
        leads = transfer_leadership_away(group.syncobj, peers[first:] + peers[:first], _node)
        if not leads or now >= until:
            with self._handing_lock:
                self._handing_away.pop(shard, None)

    def _observe(self, group: Group, now: float) -> None:
        node = group.syncobj._getLeader()
        leader = self._base_of(node.address, group.shard) if node is not None else None
        # pysyncobj keeps naming a dead leader while this node is connected to no one
        # (it only stands for election when connected to someone): a leader we have no
        # connection to is no leader, or a lone survivor never falls back to the leases.
        if leader not in (None, self.config.self_addr) and not group.syncobj.isNodeConnected(node):
            leader = None
        if leader is not None:
            group.leader_seen = now
        if leader != group.leader:
            if leader is not None:
                group.changes += 1
                self.leadership_changes += 1
                self._stable_since = now
                event(
                    log,
                    logging.INFO,
                    "raft.leader",
                    shard=group.shard,
                    leader=leader,
                    term=group.syncobj.raftCurrentTerm,
                    me=leader == self.config.self_addr,
                )
            group.leader = leader
            self.changed.set()

    def _base_of(self, address: str, shard: int) -> str:
        host, _, port = address.rpartition(":")
        return f"{host}:{int(port) - shard}"

    def _balance(self, now: float) -> None:
        """Hand over a few leaderships when this node leads more than its share.

        Only when every group has had the same leader for a while (a failover in progress
        is left alone: transfers then made failover slower in the spike), and at most
        :data:`BALANCE_STEP` groups per round, to peers connected in that group.
        """
        if now - self._stable_since < self.config.balance_s:
            return
        if any(g.leader is None for g in self.groups.values()):
            return
        counts: dict[str, int] = {}
        for g in self.groups.values():
            counts[g.leader or ""] = counts.get(g.leader or "", 0) + 1
        first = next(iter(self.groups.values()))
        alive = [self.config.self_addr] + [
            p
            for p in self.config.peers
            if first.syncobj.isNodeConnected(_node(self.config.group_address(p, first.shard)))
        ]
        share = math.ceil(len(self.groups) / len(alive))
        mine = sorted(s for s, g in self.groups.items() if g.leader == self.config.self_addr)
        excess = len(mine) - share
        for shard in reversed(mine[len(mine) - min(excess, BALANCE_STEP) :] if excess > 0 else []):
            target = min(alive[1:], key=lambda p: counts.get(p, 0), default=None)
            if target is None or counts.get(target, 0) >= share:
                return
            counts[target] = counts.get(target, 0) + 1
            with self._handing_lock:  # see _transfer_away; given up after 3 heartbeats
                self._handing_away.setdefault(shard, (target, now + 3 * self.config.heartbeat_s))
            event(log, logging.INFO, "raft.transfer", shard=shard, to=target)

    # -- the worker's interface ----------------------------------------------------------

    def hand_away(self, shards: list[int]) -> None:
        """Hand the leadership of ``shards`` that this node leads to its peers (a stopping
        node: the peers then take those shards' leases at once, with no election timeout
        to wait for). The sidecar stops replicating them and asks pysyncobj for a transfer
        (Raft's TimeoutNow) every turn until another node leads."""
        with self._handing_lock:
            for shard in shards:
                if shard in self.groups:
                    self._handing_away[shard] = (None, math.inf)

    def leads_any(self, shards: list[int]) -> bool:
        """True while this node still leads one of ``shards``."""
        return any(self.is_leader(s) for s in shards)

    def is_leader(self, shard: int) -> bool:
        """True when this node is shard ``shard``'s Raft leader."""
        group = self.groups.get(shard)
        return group is not None and bool(group.syncobj._isLeader())

    def term(self, shard: int) -> int:
        """This node's current Raft term of shard ``shard``."""
        return int(self.groups[shard].syncobj.raftCurrentTerm)

    def leader_of(self, shard: int) -> str | None:
        """The base address of shard ``shard``'s last known leader, or None."""
        return self.groups[shard].leader

    def led_by_other(self, shard: int) -> bool:
        """True when another node is known to lead shard ``shard``'s group."""
        leader = self.groups[shard].leader
        return leader is not None and leader != self.config.self_addr

    def has_quorum(self, shard: int) -> bool:
        """A leader is known, or was within one election timeout (else: lease fallback)."""
        group = self.groups[shard]
        if group.leader is not None:
            return True
        return time.monotonic() - group.leader_seen < self.config.election_max_s

    def replicate(self, shard: int, batch: dict[str, Any]) -> None:
        """Queue ``batch`` for the sidecar to append (never blocks; big ones are split;
        :data:`durable.raft.state.MAX_COMMAND_ENTRIES`)."""
        group = self.groups.get(shard)
        if group is None:
            return
        added, removed = batch["add"], batch["remove"]
        if len(added) + len(removed) <= MAX_COMMAND_ENTRIES:
            group.outbox.put(batch)
            return
        for i in range(0, max(len(added), len(removed)), MAX_COMMAND_ENTRIES):
            chunk = {**batch, "add": added[i : i + MAX_COMMAND_ENTRIES]}
            chunk["remove"] = removed[i : i + MAX_COMMAND_ENTRIES]
            group.outbox.put(chunk)

    def hand_over(self, shard: int, handed: Handed) -> None:
        """Queue a turn's journal as it is (the fire path's whole part of replication: no
        copy, no conversion); the sidecar shapes it (:func:`durable.raft.state.shape`)."""
        group = self.groups.get(shard)
        if group is not None:
            group.outbox.put(handed)

    def standby_due(self, shard: int, ahead_ms: int | None = 0) -> list[tuple[int, int]]:
        """Shard ``shard``'s standby timers due within ``ahead_ms`` (``None``: all), as
        ``(id, fire_at_ms)`` oldest first, for a warm takeover (:mod:`.standby`)."""
        consumer = self.groups[shard].consumer
        upto = 2**63 - 1 if ahead_ms is None else self.now_ms() + ahead_ms
        with consumer.lock:
            return standby.overdue(consumer.state.pending, upto)

    def state_of(self, shard: int) -> ShardState:
        """The replicated state of shard ``shard`` as applied on this node."""
        state: ShardState = self.groups[shard].consumer.state
        return state

    def status(self) -> dict[int, dict[str, Any]]:
        """Per shard: role, term, leader, replication lag, standby size."""
        out = {}
        for shard, group in self.groups.items():
            leader = bool(group.syncobj._isLeader())
            out[shard] = {
                "role": "leader" if leader else ("follower" if group.leader else "candidate"),
                "term": int(group.syncobj.raftCurrentTerm),
                "leader": group.leader or "",
                "lag_ms": int(group.consumer.lag_ms),
                "standby": len(group.consumer.state.pending),
            }
        return out


def _node(address: str) -> Any:
    from pysyncobj.node import TCPNode

    return TCPNode(address)
