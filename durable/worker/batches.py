"""What the firer's batches are made of, and what each one did per shard."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from durable.dispatch.context import FireContext
from durable.dispatch.registry import HandlerSpec
from durable.storage import firing as store
from durable.worker.outcomes import Readd
from durable.worker.runner import ShardRunner

#: One batch of work: owned shards' runners, each with some of its due ids.
Work = Sequence[tuple[ShardRunner, Sequence[int]]]


@dataclass(slots=True)
class BatchOutcome:
    """What one batch did in one shard; the engine turns it into metrics and wheel updates."""

    fired: list[tuple[store.DueTimer, Any]] = field(default_factory=list)
    errors: list[tuple[store.DueTimer, BaseException]] = field(default_factory=list)
    external: list[tuple[store.DueTimer, HandlerSpec]] = field(default_factory=list)
    leftover: list[store.DueTimer] = field(default_factory=list)
    """Due timers the batch did not run (its time budget was spent): back to the wheel."""
    alone: list[store.DueTimer] = field(default_factory=list)
    """Suspects with atomic handlers, held back to fire in a batch of their own."""
    waiting: list[store.DueTimer] = field(default_factory=list)
    """External timers the batch did not take, no thread being free: parked until one is."""
    readd: list[Readd] = field(default_factory=list)
    lateness_ms: list[int] = field(default_factory=list)
    lost: str = ""
    """Why the shard's lease was found lost (nothing fired), or empty."""


def merge(into: BatchOutcome, other: BatchOutcome) -> None:
    """Add ``other``'s lists to ``into`` (outcomes of one shard from several batches)."""
    into.fired += other.fired
    into.errors += other.errors
    into.external += other.external
    into.leftover += other.leftover
    into.waiting += other.waiting
    into.readd += other.readd
    into.lateness_ms += other.lateness_ms


def pack(work: Work, size: int) -> list[Work]:
    """Cut the due ids of many shards into batches of at most ``size`` ids in all.

    Shards keep their order and each shard's ids stay oldest first; a shard with more
    than ``size`` due ids is split across consecutive batches.
    """
    batches: list[Work] = []
    current: list[tuple[ShardRunner, Sequence[int]]] = []
    room = size
    for runner, ids in work:
        start = 0
        while start < len(ids):
            take = ids[start : start + room]
            current.append((runner, take))
            start += len(take)
            room -= len(take)
            if room == 0:
                batches.append(current)
                current, room = [], size
    if current:
        batches.append(current)
    return batches


def in_turn_order(runners: Iterable[ShardRunner], first_shard: int) -> list[ShardRunner]:
    """The runners by shard number, starting at ``first_shard`` and wrapping around.

    A turn whose budget ran out makes the next one start after the last shard it fired
    in: always starting at shard 0 would let the low shards' backlog starve the others.
    """
    return sorted(runners, key=lambda r: (r.shard < first_shard, r.shard))


def put_back(rest: list[Work], now_ms: int) -> None:
    """Give the ids of batches a turn did not fire back to their runners' wheels."""
    for batch in rest:
        for runner, ids in batch:
            runner.put_back(ids, now_ms)


def fire_context(
    timer: store.DueTimer, now_ms: int, token: int, metrics: Any = None
) -> FireContext:
    """What ``durable.current_fire()`` tells an atomic handler the batch runs."""
    return FireContext(
        timer_id=timer.id,
        key=timer.key,
        attempt=timer.attempts,
        scheduled_ms=timer.fire_at_ms,
        fired_ms=now_ms,
        shard=timer.shard,
        token=token,
        metrics=metrics,
    )
