"""Count a batch's attempts before it runs, and leave out the rows another session holds.

The firer's first step for every batch (:class:`~durable.worker.firer.Firer`): one
statement (:func:`durable.storage.claims.count_attempts`) counts an attempt for each due
timer under the shards' lease tokens and commits before any handler runs. Shards found
lost drop out and the rest is counted again. On PostgreSQL a due row another session
holds locked is skipped by the count, and :func:`skip_locked` takes it out of the batch
and puts it back in its runner's wheel :data:`LOCKED_RETRY_MS` later, so that one held
row does not hold the worker's whole fire loop.
"""

from __future__ import annotations

import logging

from durable.core.clock import Clock
from durable.metrics import WorkerMetrics
from durable.storage import claims
from durable.worker.attempts import AttemptTracker
from durable.worker.batches import Work
from durable.worker.logs import event
from durable.worker.runner import ShardRunner

log = logging.getLogger("durable.worker")

__all__ = ["LOCKED_RETRY_MS", "count", "recount", "skip_locked"]

LOCKED_RETRY_MS = 100
"""How long after a turn found a due timer's row locked by another session (PostgreSQL:
a transaction that cancelled or rescheduled it and is still open) its runner tries it
again. The batch leaves it out (:attr:`durable.storage.claims.Counted.locked`) rather
than wait for that transaction, which held the whole fire loop; short, so that the
timer fires soon after the lock ends, and not zero, so that a row held for minutes is
re-read ten times a second, not in a busy loop."""


def count(db: str, clock: Clock, work: Work, lost: dict[int, str]) -> claims.Counted:
    """Count the attempts of the work's due timers, committed before any runs.

    Shards found lost are added to ``lost`` and counted without.
    """
    while work:
        tokens = {runner.shard: runner.token for runner, _ in work}
        ids = [timer_id for _, chunk in work for timer_id in chunk]
        with claims.counting(db):
            counted = claims.count_attempts(db, tokens, ids, clock.now_ms())
        if not counted.stale:
            return counted
        for shard, current in counted.stale.items():
            lost[shard] = f"lease of shard {shard} lost: token is stale (now {current})"
        work = [(runner, ids) for runner, ids in work if runner.shard not in lost]
    return claims.Counted()


def recount(
    db: str,
    clock: Clock,
    part: Work,
    counted: claims.Counted,
    lost: dict[int, str],
    tracker: AttemptTracker,
) -> set[int]:
    """Count a held suspect's attempt, now that it runs alone (into ``counted`` and the
    ``tracker``'s tokens); return the ids found locked (not counted: :func:`skip_locked`
    retries them)."""
    more = count(db, clock, part, lost)
    for runner, ids in part:
        counted.held.difference_update(ids)
        tracker.tokens.update((i, runner.token) for i in ids if i in more.ids)
    counted.ids.update(more.ids)
    counted.suspects.update(more.suspects)
    counted.attempts.update(more.attempts)
    counted.previous.update(more.previous)
    return more.locked


def skip_locked(
    clock: Clock, work: Work, locked: set[int], metrics: WorkerMetrics | None = None
) -> Work:
    """``work`` without the timers whose rows another session holds locked: each goes
    back to its runner's wheel, due :data:`LOCKED_RETRY_MS` from now, and is counted in
    ``durable_timers_locked_skipped_total`` (a row held for long shows there, once per
    retry, where the DEBUG log line does not).

    Nothing was counted for them. A row that stays locked is retried so until it is
    free (and the rescan finds it too, should the wheel lose it); one whose locking
    transaction cancelled it is found not due then, and dropped.
    """
    if not locked:
        return work
    retry_at = clock.now_ms() + LOCKED_RETRY_MS
    kept: list[tuple[ShardRunner, list[int]]] = []
    for runner, ids in work:
        skipped = [i for i in ids if i in locked]
        if skipped:
            runner.put_back(skipped, retry_at)
            if metrics is not None:
                metrics.on_locked_skipped(runner.shard, len(skipped))
        rest = [i for i in ids if i not in locked]
        if rest:
            kept.append((runner, rest))
    event(log, logging.DEBUG, "batch.locked_skipped", timers=len(locked), retry_ms=LOCKED_RETRY_MS)
    return kept
