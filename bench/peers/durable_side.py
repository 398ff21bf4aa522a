"""durable's side of the timer benchmark: handlers, fast inserts, an in-process worker.

The handlers must be importable by dotted name (``bench.peers.durable_side.noop``) because
a real ``manage.py run_timer_shards`` subprocess resolves them that way; ``manage.py``
puts the repository root on ``sys.path``, so ``bench`` imports as a namespace package.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from django.db import connections, transaction

import durable
from bench._common import Recorder, wall_ms
from durable.conf import get_settings
from durable.dispatch.context import current_fire

#: Lateness samples (fired wall ms - due ms) of the in-process worker's handlers.
RECORDER = Recorder()

EFFECT_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_effect "
    "(ref bigint NOT NULL, due_ms bigint NOT NULL, fired_ms double precision NOT NULL)"
)


@durable.handler
def noop() -> None:
    """The no-op atomic handler: records its lateness in memory, touches no table."""
    ctx = current_fire()
    RECORDER.events.append((ctx.scheduled_ms, wall_ms()))  # type: ignore[union-attr]


@durable.handler
def write(ref: int) -> None:
    """An atomic handler with an effect: one INSERT in the firing transaction."""
    ctx = current_fire()
    assert ctx is not None
    fired = wall_ms()
    with connections[get_settings().DATABASE].cursor() as cursor:
        cursor.execute(
            "INSERT INTO bench_effect (ref, due_ms, fired_ms) VALUES (%s, %s, %s)",
            [ref, ctx.scheduled_ms, fired],
        )
    RECORDER.events.append((ctx.scheduled_ms, fired))


NOOP = "bench.peers.durable_side.noop"
WRITE = "bench.peers.durable_side.write"


# --- tables ------------------------------------------------------------------------------


def raw(sql: str, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """Run one statement on durable's database (autocommit) and return its rows."""
    with connections[get_settings().DATABASE].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if cursor.description else []


def reset_tables() -> None:
    """Empty timers, leases, nodes and effects: each section starts from a clean slate."""
    raw(EFFECT_DDL)
    raw("TRUNCATE durable_timer, durable_workernode, bench_effect, demo_firerecord CASCADE")
    raw("UPDATE durable_shardlease SET owner = '', expires_at = NULL, cursor_ms = 0")
    raw("VACUUM ANALYZE durable_timer")


def pending_count() -> int:
    """Pending rows in durable_timer."""
    return int(raw("SELECT count(*) FROM durable_timer WHERE state = 'pending'")[0][0])


# --- scheduling ----------------------------------------------------------------------------


def to_dt(ms: float) -> datetime:
    """Epoch ms → aware datetime (the public API takes datetimes)."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def schedule_many(fire_at_ms: Sequence[int], target: str = NOOP, chunk: int = 5_000) -> float:
    """``durable.schedule_many`` in transactions of ``chunk`` timers; return the seconds taken."""
    db = get_settings().DATABASE
    started = time.perf_counter()
    for start in range(0, len(fire_at_ms), chunk):
        part = fire_at_ms[start : start + chunk]
        if target == WRITE:
            specs = [
                {"fn": target, "at": to_dt(ms), "args": [start + i]} for i, ms in enumerate(part)
            ]
        else:
            specs = [{"fn": target, "at": to_dt(ms)} for ms in part]
        with transaction.atomic(using=db):
            durable.schedule_many(specs)
    return time.perf_counter() - started


def schedule_one_per_transaction(n: int, fire_at_ms: int) -> float:
    """``durable.schedule`` n times in autocommit mode (one transaction each)."""
    at = to_dt(fire_at_ms)
    started = time.perf_counter()
    for _ in range(n):
        durable.schedule(NOOP, at=at)
    return time.perf_counter() - started


class RawInserter:
    """The raw baseline of :func:`schedule_one_per_transaction`: the same row by hand.

    A plain psycopg connection in autocommit mode, one statement per transaction, with
    psycopg's defaults (server-side binding; the statement is prepared after its fifth
    use, which Django's connections do not do). The row is the one ``schedule(NOOP,
    at=...)`` writes: the same table and values, a random shard, the clock stamps from
    Python. With ``notify``, the same ``pg_notify`` as schedule() sends, folded into the
    statement; without, a bare INSERT + commit (the naive peer's narrow table is not the
    same work). Call it with a count; it returns the seconds those inserts took.
    """

    def __init__(self, fire_at_ms: int, *, notify: bool) -> None:
        from bench._common import DURABLE_URL, connect

        conf = get_settings()
        insert = (
            "INSERT INTO durable_timer (shard, bucket, fire_at_ms, state, kind, target, args,"
            " kwargs, attempts, max_attempts, backoff_base_s, backoff_max_s, on_complete,"
            " last_error, created_at, updated_at) VALUES (%s, %s, %s, 'pending', 'handler',"
            " %s, %s, %s, 0, 5, 1.0, 3600.0, '', '', %s, %s) RETURNING id, shard"
        )
        self.sql = insert
        if notify:
            self.sql = (
                f"WITH t AS ({insert}) SELECT id, pg_notify(%s, shard::text || ',' ||"
                " id::text || ',' || %s::text) FROM t"
            )
        self.notify = notify
        self.fire_at_ms = fire_at_ms
        self.bucket = fire_at_ms >> conf.BUCKET_SHIFT
        self.shards = conf.SHARDS
        self.conn = connect(DURABLE_URL)

    @classmethod
    def narrow(cls, fire_at_ms: int) -> RawInserter:
        """Issue 16's original baseline, alternated the same way: the naive peer's
        two-column ``bench_naive_timer`` (``naive_poller.prepare`` first), no NOTIFY."""
        inserter = cls(fire_at_ms, notify=False)
        inserter.sql = "INSERT INTO bench_naive_timer (fire_at, handler) VALUES (%s, 'noop')"
        inserter.narrow_at = to_dt(fire_at_ms)
        return inserter

    narrow_at: datetime | None = None

    def __call__(self, n: int) -> float:
        import random

        from psycopg.types.json import Jsonb

        from durable.storage.notify import CHANNEL

        execute = self.conn.execute
        started = time.perf_counter()
        if self.narrow_at is not None:
            started = time.perf_counter()
            for _ in range(n):
                execute(self.sql, [self.narrow_at])
            return time.perf_counter() - started
        for _ in range(n):
            now = datetime.now(tz=UTC)
            params = [random.randrange(self.shards), self.bucket, self.fire_at_ms, NOOP]
            params += [Jsonb([]), Jsonb({}), now, now]
            if self.notify:
                params += [CHANNEL, str(self.fire_at_ms)]
            execute(self.sql, params).fetchone()
        return time.perf_counter() - started

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


def schedule_against_raw(n: int, fire_at_ms: int, chunk: int = 100) -> dict[str, float]:
    """schedule() and the two raw baselines, alternated ``chunk`` calls at a time.

    Returns the rate of each (``schedule``, ``raw_notify``, ``raw``, ``narrow``: issue
    16's two-column INSERT): alternating in small chunks gives them all the same share of
    a shared machine's load.
    """
    inserters = {
        "raw_notify": RawInserter(fire_at_ms, notify=True),
        "raw": RawInserter(fire_at_ms, notify=False),
        "narrow": RawInserter.narrow(fire_at_ms),
    }
    spent = {"schedule": 0.0, **dict.fromkeys(inserters, 0.0)}
    try:
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            spent["schedule"] += schedule_one_per_transaction(size, fire_at_ms)
            for name, inserter in inserters.items():
                spent[name] += inserter(size)
    finally:
        for inserter in inserters.values():
            inserter.close()
    return {name: n / seconds for name, seconds in spent.items()}


def sql_insert(
    n: int, first_ms: int, step_ms: float, *, shard: int | None = None, target: str = NOOP
) -> float:
    """Insert ``n`` pending timers straight into durable_timer with ``generate_series``.

    A benchmark shortcut for the 1M/5M-row set-ups (the public ``schedule_many`` would
    take minutes); the rows are exactly what ``schedule()`` writes for a plain handler.
    ``fire_at_ms = first_ms + i * step_ms``; shards round-robin unless ``shard`` is given.
    """
    conf = get_settings()
    shard_expr = "%s" if shard is not None else f"(i %% {conf.SHARDS})"
    sql = f"""
        INSERT INTO durable_timer (shard, bucket, fire_at_ms, state, kind, target, args,
            kwargs, attempts, max_attempts, backoff_base_s, backoff_max_s, on_complete,
            last_error, created_at, updated_at)
        SELECT {shard_expr}, f >> {conf.BUCKET_SHIFT}, f, 'pending', 'handler', %s, '[]',
            '{{}}', 0, 5, 1, 3600, '', '', now(), now()
        FROM (SELECT i, (%s + floor(i * %s::float8))::bigint AS f
              FROM generate_series(0, %s - 1) AS i) AS s
    """
    params: list[Any] = [shard] if shard is not None else []
    params += [target, first_ms, step_ms, n]
    started = time.perf_counter()
    raw(sql, params)
    return time.perf_counter() - started


# --- the worker, in-process ------------------------------------------------------------------


class EngineThread:
    """``Engine.run()`` in a thread of this process: the real loop (leases, NOTIFY, rescans,
    wheel, fenced batches), with its handlers' lateness visible in :data:`RECORDER`."""

    def __init__(self, node: str = "bench-worker") -> None:
        from durable.worker.engine import Engine

        self.engine = Engine(node=node, threads=1)
        self.thread = threading.Thread(target=self._run, name="durable-engine", daemon=True)

    def _run(self) -> None:
        try:
            self.engine.run()
        finally:
            connections.close_all()

    def start(self, timeout_s: float = 60.0) -> float:
        """Start and wait until it holds every shard; return the seconds that took."""
        started = time.perf_counter()
        self.thread.start()
        shards = get_settings().SHARDS
        deadline = time.monotonic() + timeout_s
        while len(self.engine.runners) < shards:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker holds {len(self.engine.runners)}/{shards} shards")
            time.sleep(0.01)
        return time.perf_counter() - started

    @property
    def fired(self) -> int:
        """Timers fired so far (the engine's own counter)."""
        return self.engine.stats.fired

    def stop(self) -> None:
        """Stop the loop and release the leases."""
        self.engine.stop()
        self.thread.join(timeout=60)
