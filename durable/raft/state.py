"""The replicated state of one shard: what its Raft log applies, in batches.

A batch is a plain dict of ints, strings and lists (the worker builds it; see
:func:`make_batch`): the owner that sent it (node, lease token, Raft term), the shard's
``cursor_ms``, the ``(id, fire_at_ms)`` added to its horizon (scheduled, NOTIFY'd, found
by a rescan, re-added for a retry) and the ids that left it (fired, or cancelled and
skipped). :meth:`ShardState.apply` is deterministic, so every replica that applies the
same log holds the same state; a malformed batch is refused whole, never half applied.
The database stays the truth: this state only keeps a standby warm.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_COMMAND_ENTRIES = 1_000
"""Largest number of timer entries in one Raft command (a rebuild of a million timers
is replicated as many commands, so no one message blocks the group's heartbeats)."""


class BadBatch(ValueError):
    """A batch that does not have the shape :func:`make_batch` gives; nothing applied."""


def make_batch(
    *,
    owner: str,
    token: int,
    term: int,
    cursor_ms: int,
    added: Iterable[tuple[int, int]] = (),
    removed: Iterable[int] = (),
    at_ms: int = 0,
) -> dict[str, Any]:
    """The batch the owner of a shard replicates after a commit."""
    return {
        "owner": owner,
        "token": int(token),
        "term": int(term),
        "cursor_ms": int(cursor_ms),
        "add": [[int(i), int(t)] for i, t in added],
        "remove": [int(i) for i in removed],
        "at_ms": int(at_ms),
    }


@dataclass(frozen=True, slots=True)
class Handed:
    """One turn's wheel changes of a shard, handed by the worker to the sidecar as they
    are: ``journal`` maps an id to its fire time (entered the horizon) or None (left it).
    The worker gives up the dict; only the sidecar reads it after."""

    owner: str
    token: int
    cursor_ms: int
    journal: dict[int, int | None]
    at_ms: int


def _check(batch: Any) -> None:
    if not isinstance(batch, Mapping):
        raise BadBatch(f"a batch is a dict, got {type(batch).__name__}")
    if not isinstance(batch.get("owner"), str):
        raise BadBatch("batch['owner'] must be a str")
    for key in ("token", "term", "cursor_ms", "at_ms"):
        value = batch.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadBatch(f"batch[{key!r}] must be an int")
    add, remove = batch.get("add"), batch.get("remove")
    if not isinstance(add, list) or not all(
        isinstance(p, list | tuple) and len(p) == 2 and all(type(x) is int for x in p) for p in add
    ):
        raise BadBatch("batch['add'] must be a list of [id, fire_at_ms] ints")
    if not isinstance(remove, list) or not all(type(x) is int for x in remove):
        raise BadBatch("batch['remove'] must be a list of int ids")


@dataclass(slots=True)
class ShardState:
    """One shard's replicated state (identical on every replica of its group)."""

    owner: str = ""
    token: int = 0
    term: int = 0
    cursor_ms: int = 0
    pending: dict[int, int] = field(default_factory=dict)
    batches: int = 0
    last_at_ms: int = 0

    def apply(self, batch: Any) -> None:
        """Apply one batch; raises :class:`BadBatch` (changing nothing) on a bad one.

        A batch from an older owner (a lower token) than the one already recorded is a
        late message of a node that lost the shard: it is ignored, so it cannot move the
        cursor back or resurrect fired timers.
        """
        _check(batch)
        if batch["token"] < self.token:
            return
        self.owner, self.token = batch["owner"], batch["token"]
        self.term = max(self.term, batch["term"])
        self.cursor_ms = max(self.cursor_ms, batch["cursor_ms"])
        for timer_id in batch["remove"]:
            self.pending.pop(timer_id, None)
        self.pending.update(batch["add"])
        self.batches += 1
        self.last_at_ms = batch["at_ms"]


def shape(handed: Handed, term: int) -> list[dict[str, Any]]:
    """A handed journal as batches of at most :data:`MAX_COMMAND_ENTRIES` entries (the
    sidecar calls this, so the conversion never runs on the worker's fire path)."""
    added = [(i, t) for i, t in handed.journal.items() if t is not None]
    removed = [i for i, t in handed.journal.items() if t is None]
    return [
        make_batch(
            owner=handed.owner,
            token=handed.token,
            term=term,
            cursor_ms=handed.cursor_ms,
            added=added[i : i + MAX_COMMAND_ENTRIES],
            removed=removed[i : i + MAX_COMMAND_ENTRIES],
            at_ms=handed.at_ms,
        )
        for i in range(0, max(len(added), len(removed), 1), MAX_COMMAND_ENTRIES)
    ]
