"""A follower's standby: the shard's replicated pending timers, read at takeover.

Fed by the Raft log a shard's owner replicates (:mod:`durable.raft.state`), a follower's
:class:`~durable.raft.state.ShardState` holds the ids and fire times the owner's wheel
holds. It never fires. When this node becomes the owner, :func:`overdue` gives the ids
already due, which the worker fires at once while its usual rebuild from the rows runs. A
stale entry (fired or cancelled meanwhile) costs nothing: every fire is fenced and
re-checks the row's state, so it can neither fire twice nor fire early.

Why no second timing wheel beside the replicated dict: a standby never advances, so a
wheel's O(1) advance buys nothing, and it cost memory: with 1M timers (tracemalloc, the
containers only) the owner's wheel took 74.6 MB, the replicated dict 41.9 MB, and the
dict plus a standby wheel 116.5 MB, 1.56x the owner's wheel (the target is 1.2x). Reading
the due ones out of the dict at takeover is one pass over the shard's entries (see
``bench/failover.py --only memory``, which reports both figures).
"""

from __future__ import annotations

from collections.abc import Mapping


def overdue(pending: Mapping[int, int], now_ms: int) -> list[tuple[int, int]]:
    """The timers of ``pending`` (id to fire time) due at ``now_ms``, as ``(id,
    fire_at_ms)``, oldest first (ties by id)."""
    due = [(fire_at, timer_id) for timer_id, fire_at in pending.items() if fire_at <= now_ms]
    due.sort()
    return [(timer_id, fire_at) for fire_at, timer_id in due]
