"""PROTOTYPE of a proposed engine change, measured by ``bench/timers.py`` as evidence only.

The shipped engine fires each shard's due timers in that shard's own transaction. At a
steady 2,000 timers/s over 64 shards, one loop turn finds a timer or two in most shards
and pays about five round trips and a commit (a WAL flush) per shard: lateness is then the
time of ~64 small transactions. This variant fires the due timers of several shards in one
transaction of at most ``BATCH_SIZE`` timers, with a constant number of statements:

1. one ``SELECT ... FROM durable_shardlease WHERE shard = ANY(...) ORDER BY shard FOR
   UPDATE`` that locks every lease row the transaction touches (in shard order, so two
   such transactions never deadlock) and checks each token: ``fence()`` for many shards;
2. one ``SELECT ... FOR UPDATE`` of the due rows of all those shards (a row is fired only
   by the runner of the shard it is in);
3. the handlers, then one ``UPDATE`` marking them fired, each with its shard's token.

Semantics are kept: anything unusual (a handler raising, an external handler, a follow-up,
a lost lease) rolls the group back and fires its shards one by one through the shipped
path, which handles it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from django.db import connections, transaction

from durable.exceptions import LeaseLost
from durable.storage import firing as store
from durable.storage.leases import ms_to_dt
from durable.worker.engine import Engine
from durable.worker.firer import BatchOutcome, _Rollback
from durable.worker.logs import event
from durable.worker.runner import ShardRunner

log = logging.getLogger("durable.worker")

Work = list[tuple[ShardRunner, list[int]]]


class GroupedEngine(Engine):
    """``Engine`` whose ``_fire_due`` fires small per-shard batches together."""

    def _fire_due(self) -> int:
        now = self.clock.now_ms()
        work: Work = []
        for runner in list(self.runners.values()):
            ids = runner.due(now)
            if ids:
                work.append((runner, ids))
            else:
                runner.cursor_ms = now
        fired = 0
        for group in _pack(work, self.conf.BATCH_SIZE):
            if len(group) > 1:
                try:
                    fired += self._count(self._fire_group(group))
                    for runner, _ in group:
                        runner.cursor_ms = now
                    continue
                except (_Rollback, LeaseLost):
                    pass  # rolled back: fire these shards one by one below
            for runner, ids in group:
                fired += self._fire_one(runner, ids, now)
        self.stats.fired += fired
        return fired

    def _fire_group(self, group: Work) -> list[tuple[ShardRunner, BatchOutcome]]:
        firer, db = self.firer, self.db
        now_ms = self.clock.now_ms()
        runners = {runner.shard: runner for runner, _ in group}
        shard_of = {timer_id: runner.shard for runner, ids in group for timer_id in ids}
        outs = {shard: BatchOutcome() for shard in runners}
        with transaction.atomic(using=db):
            _fence_many(db, {shard: r.token for shard, r in runners.items()})
            for timer in _lock_due_many(db, list(shard_of), list(runners), now_ms):
                if shard_of.get(timer.id) != timer.shard:
                    continue  # not this runner's row (moved shard): the row is the truth
                out = outs[timer.shard]
                out.lateness_ms.append(now_ms - timer.fire_at_ms)
                firer._run_one(timer, now_ms, runners[timer.shard].token, None, out)
            if any(o.errors or o.external or any(t.on_complete for t, _ in o.fired)
                   for o in outs.values()):  # fmt: skip
                raise _Rollback(0, RuntimeError("grouped"))  # the shipped path takes over
            _mark_fired_many(
                db,
                [(t.id, runners[s].token) for s, o in outs.items() for t, _ in o.fired],
                now_ms,
            )
        done = [(runners[shard], out) for shard, out in outs.items()]
        for runner, out in done:
            firer._after_commit(runner, out)
        return done

    def _fire_one(self, runner: ShardRunner, ids: Sequence[int], now: int) -> int:
        try:
            outcomes = self.firer.fire(runner, ids)
        except LeaseLost as exc:
            event(log, logging.WARNING, "lease.lost", shard=runner.shard, reason=str(exc))
            self.runners.pop(runner.shard, None)
            return 0
        if not any(o.leftover for o in outcomes):
            runner.cursor_ms = now
        return self._count((runner, o) for o in outcomes)

    def _count(self, outcomes) -> int:  # type: ignore[no-untyped-def]
        fired = 0
        for _, out in outcomes:
            fired += len(out.fired)
            self.stats.errors += len(out.errors)
            if self.stats.keep_lateness:
                self.stats.lateness_ms.extend(out.lateness_ms)
        return fired


def _pack(work: Work, size: int) -> list[Work]:
    """Groups of whole shards holding at most ``size`` ids; a larger shard goes alone."""
    groups: list[Work] = []
    current: Work = []
    count = 0
    for runner, ids in work:
        if len(ids) >= size:
            groups.append([(runner, ids)])
            continue
        if count + len(ids) > size:
            groups.append(current)
            current, count = [], 0
        current.append((runner, ids))
        count += len(ids)
    if current:
        groups.append(current)
    return groups


def _fence_many(db: str, tokens: dict[int, int]) -> None:
    """``fence()`` for several shards in one statement: lock their lease rows, check tokens."""
    with connections[db].cursor() as cursor:
        cursor.execute(
            "SELECT shard, token FROM durable_shardlease WHERE shard = ANY(%s::int[])"
            " ORDER BY shard FOR UPDATE",
            ["{" + ",".join(map(str, sorted(tokens))) + "}"],
        )
        found = dict(cursor.fetchall())
    for shard, token in tokens.items():
        if found.get(shard) != token:
            raise LeaseLost(
                f"lease of shard {shard} lost: token {token} is stale",
                shard=shard,
                token=token,
                current_token=found.get(shard),
            )


def _lock_due_many(db: str, ids: list[int], shards: list[int], now_ms: int) -> list[Any]:
    """``lock_due`` over several shards (same conditions, one statement)."""
    sql = (
        f"SELECT {store._DUE_COLUMNS} FROM durable_timer WHERE id = ANY(%s::bigint[])"
        f" AND shard = ANY(%s::int[]) AND {store._NOT_FINISHED}"
        " AND (state = %s OR claim_expires_ms <= %s) ORDER BY fire_at_ms, id FOR UPDATE"
    )
    with connections[db].cursor() as cursor:
        cursor.execute(
            sql,
            [_array(ids), _array(shards), *store._FINISHED, store._PENDING, now_ms],
        )
        return list(map(store.DueTimer._make, cursor.fetchall()))


def _mark_fired_many(db: str, fired: list[tuple[int, int]], now_ms: int) -> None:
    """``mark_fired`` for rows of several shards, each stamped with its shard's token."""
    if not fired:
        return
    when = ms_to_dt(now_ms)
    with connections[db].cursor() as cursor:
        cursor.execute(
            "UPDATE durable_timer AS t SET state = 'fired', fired_token = v.token,"
            " fired_at = %s, updated_at = %s, claim_expires_ms = NULL, last_error = '',"
            " attempts = CASE WHEN t.state = 'pending' THEN t.attempts + 1 ELSE t.attempts END"
            " FROM unnest(%s::bigint[], %s::bigint[]) AS v(id, token)"
            f" WHERE t.id = v.id AND t.{store._NOT_FINISHED}",
            [when, when, _array(i for i, _ in fired), _array(t for _, t in fired),
             *store._FINISHED],
        )  # fmt: skip


def _array(values: Any) -> str:
    return "{" + ",".join(map(str, map(int, values))) + "}"
