"""One poller for every Raft group of a node: the sidecar sleeps in one ``poll``.

pysyncobj gives each ``SyncObj`` its own poller, and a manual ``doTick(0)`` polls it: 64
groups meant 64 ``poll`` system calls every tick, 1,280 a second at the 50 ms tick, and
a message that arrived just after its group's poll waited a whole tick to be read. Here
every group's sockets subscribe to one poller (:func:`shared_poller`). The sidecar blocks in it
between turns (the GIL free, so the worker's fire path runs), reads each message the
moment it arrives (a vote, a heartbeat, an append) and runs the groups' timer work (elections,
heartbeats, commits) once per tick. The groups keep a :class:`GroupPoller`, whose
``poll`` does nothing: pysyncobj's tick ends with a poll of its own poller.

Also here, because they too reach into one ``SyncObj`` for the sidecar:
:func:`restart_election_timer_while_alone` and :func:`transfer_leadership_away`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


def shared_poller() -> Any:
    """pysyncobj's ``poll(2)`` poller, to be shared by every group of the node (pysyncobj
    is imported here, not with the module: with Raft off nothing of it loads)."""
    from pysyncobj.poller import PollPoller

    return PollPoller()


class GroupPoller:
    """What one ``SyncObj`` sees as its poller: subscriptions go to the shared one."""

    def __init__(self, shared: Any) -> None:
        self.shared = shared

    def subscribe(self, descr: int, callback: Callable[[int, int], None], mask: int) -> None:
        """Watch ``descr`` in the shared poller."""
        self.shared.subscribe(descr, callback, mask)

    def unsubscribe(self, descr: int) -> None:
        """Stop watching ``descr``."""
        self.shared.unsubscribe(descr)

    def poll(self, timeout: float) -> None:
        """Nothing: the sidecar polls the shared poller for every group at once."""


@contextlib.contextmanager
def groups_share(shared: Any) -> Iterator[None]:
    """While it lasts, every new ``SyncObj`` gets a :class:`GroupPoller` on ``shared``.

    pysyncobj builds its poller in ``SyncObj.__init__`` (``createPoller``, looked up in
    ``pysyncobj.syncobj``) before its transport subscribes anything; only the sidecar's
    start builds groups, on one thread.
    """
    import pysyncobj.syncobj as syncobj_module

    original: Callable[[str], Any] = syncobj_module.createPoller
    syncobj_module.createPoller = lambda kind: GroupPoller(shared)
    try:
        yield
    finally:
        syncobj_module.createPoller = original


def restart_election_timer_while_alone(syncobj: Any, now: float) -> bool:
    """Keep a group that has not yet met a peer from timing out until it has; return
    True while it is alone (the sidecar calls this only until a group first connects).

    pysyncobj stands for election only when connected to someone, but its election timer
    runs meanwhile: the first node of a cluster to start had timed out in every group by
    the time a second one came up, stood at once in all 64 and won them all (64-0-0 and
    36-0-28 splits in the benchmarks; a node that owns every shard fires them all alone).
    Restarting the timer while alone makes the sliced timeouts
    (:func:`durable.raft.config.election_window`) count from the first connection, so the
    node ranked first in each group wins it. Only at start-up: a node that loses its
    peers later (a partition, a failover with a link down) keeps pysyncobj's own rule.
    """
    if syncobj._SyncObj__connectedNodes or syncobj._isLeader():
        return False
    deadline = syncobj._SyncObj__raftElectionDeadline
    if deadline < now + syncobj._SyncObj__conf.raftMinTimeout:
        syncobj._SyncObj__raftElectionDeadline = now + syncobj._SyncObj__generateRaftTimeout()
    return True


def transfer_leadership_away(syncobj: Any, peers: list[str], node: Callable[[str], Any]) -> bool:
    """Ask pysyncobj to hand ``syncobj``'s leadership to one of ``peers`` (group
    addresses, in order of preference; a connected one, caught up), by Raft's TimeoutNow;
    return True while this node still leads (the sidecar asks again next turn).

    pysyncobj refuses a transfer to a follower not caught up with the log; a group whose
    news is no longer replicated (a stopping node's) catches up within a heartbeat or two.
    """
    if not syncobj._isLeader():
        return False
    # Only the peers named: pysyncobj's own choice (None) picks among the same connected
    # peers, and a balancing transfer must go to the peer the balancer counted.
    answers: list[bool] = []  # pysyncobj answers each request at once: refused or not
    for target in [p for p in peers if syncobj.isNodeConnected(node(p))]:
        syncobj.transferLeadership(target, lambda _res, err: answers.append(bool(err)))
        if answers and not answers[-1]:
            break
    return True
