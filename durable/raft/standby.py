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

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from durable.raft.state import BadBatch, ShardState
from durable.worker.logs import event

log = logging.getLogger("durable.raft")


def overdue(pending: Mapping[int, int], now_ms: int) -> list[tuple[int, int]]:
    """The timers of ``pending`` (id to fire time) due at ``now_ms``, as ``(id,
    fire_at_ms)``, oldest first (ties by id)."""
    due = [(fire_at, timer_id) for timer_id, fire_at in pending.items() if fire_at <= now_ms]
    due.sort()
    return [(timer_id, fire_at) for fire_at, timer_id in due]


def consumer_class() -> type:
    """The pysyncobj consumer of one shard's group (pysyncobj imported on call: with Raft
    off nothing of it loads)."""
    from pysyncobj import SyncObjConsumer, replicated

    class ShardConsumer(SyncObjConsumer):  # type: ignore[misc]
        """The pysyncobj side of one shard: applies batches to a :class:`ShardState`."""

        def __init__(self, shard: int, now_ms: Callable[[], int]) -> None:
            # Set before SyncObjConsumer.__init__, which marks the attributes present now
            # as not part of the replicated state: only ``state`` is serialized.
            self.shard = shard
            self.now_ms = now_ms
            self.lag_ms = 0
            # apply() runs on the sidecar, the takeover's read of the standby
            # (GroupSet.standby_due) on the worker's loop.
            self.lock = threading.Lock()
            super().__init__()
            self.state = ShardState()

        @replicated  # type: ignore[untyped-decorator]
        def apply(self, batch: Any) -> None:
            try:
                with self.lock:
                    self.state.apply(batch)
            except BadBatch as exc:  # only a node holding the password can get here
                event(log, logging.WARNING, "raft.bad_batch", shard=self.shard, error=exc)
                return
            if batch["at_ms"]:
                self.lag_ms = max(0, self.now_ms() - batch["at_ms"])

        def _deserialize(self, data: Any) -> None:
            with self.lock:  # a snapshot from the leader replaces the state whole
                super()._deserialize(data)

    return ShardConsumer
