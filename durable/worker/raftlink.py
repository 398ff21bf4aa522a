"""The worker's side of Raft (``DURABLE["RAFT"]``): start the groups, replicate, publish.

The engine keeps firing exactly as without Raft; this module only builds the
:class:`durable.raft.groups.GroupSet` of the node, turns each owned shard's journal into
one replicated batch per loop turn (after the turn's commits, through a queue the Raft
sidecar drains: nothing here waits on the network), and shapes the per-shard view that the
heartbeat publishes (``WorkerNode.raft``) and the metrics show.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from durable.conf import DurableSettings
from durable.core.clock import Clock

CURSOR_EVERY_MS = 10_000
"""Least time between two replications of a shard's cursor when nothing else changed
(at 1 s, 64 idle shards' cursor commands were a fifth of an idle node's Raft CPU)."""

if TYPE_CHECKING:
    from durable.raft.groups import GroupSet
    from durable.worker.runner import ShardRunner


def build(
    conf: DurableSettings,
    clock: Clock,
    scope: list[int],
    raft_self: str | None = None,
    raft_bind: str | None = None,
) -> GroupSet | None:
    """This node's Raft groups (not started), or None when ``RAFT`` is off.

    Raises :class:`durable.raft.config.RaftConfigError` naming every problem of the
    settings (with the ``--raft-self``/``--raft-bind`` overrides applied).
    """
    from durable.raft.config import parse

    config = parse(conf.RAFT, conf.SHARDS, raft_self, raft_bind)
    if config is None:
        return None
    from durable.raft.groups import GroupSet

    return GroupSet(config, scope, clock.now_ms)


def flush(raft: GroupSet, node: str, runners: Mapping[int, ShardRunner], now_ms: int) -> int:
    """Hand each led shard's journal of this turn to the sidecar; return entries handed.

    On the fire path, after the turn's commits: a dict swapped per shard and put on a
    queue, nothing converted or serialized here (the sidecar does it, off this thread).
    """
    from durable.raft.state import Handed

    sent = 0
    for shard, runner in runners.items():
        journal = runner.take_journal(now_ms)
        # The cursor alone moves every turn: replicated every CURSOR_EVERY_MS at most per
        # shard, or an idle cluster would send 64 commands per turn. (A new owner reads
        # the cursor from the lease row; the replicated one is for status and standby.)
        state = raft.state_of(shard)
        moved = runner.cursor_ms - state.cursor_ms >= CURSOR_EVERY_MS
        moved = moved or runner.token != state.token
        if not (journal or moved) or not raft.is_leader(shard):
            continue
        raft.hand_over(shard, Handed(node, runner.token, runner.cursor_ms, journal, now_ms))
        sent += len(journal)
    return sent


def view(raft: GroupSet) -> dict[int, dict[str, Any]]:
    """Per shard: ``role``, ``term``, ``leader`` (what the heartbeat publishes)."""
    return {
        shard: {"role": row["role"], "term": row["term"], "leader": row["leader"]}
        for shard, row in raft.status().items()
    }
