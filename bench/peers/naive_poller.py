"""The naive scheduler: a table of ``(id, fire_at, ...)`` rows polled every 100 ms.

What a team writes in an afternoon, done properly: one loop, each turn

    BEGIN;
    SELECT ... WHERE state = 'pending' AND fire_at <= now()
        ORDER BY fire_at LIMIT 500 FOR UPDATE SKIP LOCKED;
    -- run each handler (in this transaction: exactly once, like durable's atomic ones)
    UPDATE ... SET state = 'done' WHERE id = ANY(ids);
    COMMIT;

and it sleeps ``POLL_S`` only when a turn found fewer than ``LIMIT`` rows, so a backlog
drains at full speed. A partial index on ``fire_at`` over pending rows keeps the poll
cheap however many rows wait further out. No NOTIFY, no in-memory schedule.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench._common import Recorder, connect, wall_ms

RECORDER = Recorder()
POLL_S = 0.1
LIMIT = 500

DDL = [
    "CREATE TABLE IF NOT EXISTS bench_naive_timer (id bigserial PRIMARY KEY, "
    "fire_at timestamptz NOT NULL, handler text NOT NULL, args jsonb NOT NULL DEFAULT '{}', "
    "state text NOT NULL DEFAULT 'pending', fired_at timestamptz)",
    "CREATE INDEX IF NOT EXISTS bench_naive_pending ON bench_naive_timer (fire_at) "
    "WHERE state = 'pending'",
]


def prepare(url: str) -> None:
    """Create the table (once) and empty it."""
    with connect(url) as conn:
        for statement in DDL:
            conn.execute(statement)
        conn.execute("TRUNCATE bench_naive_timer")
        conn.execute("VACUUM ANALYZE bench_naive_timer")


def _dt(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def insert_one_per_transaction(url: str, n: int, due_ms: float) -> float:
    """One INSERT per transaction (autocommit); return the seconds."""
    at = _dt(due_ms)
    with connect(url) as conn:
        started = time.perf_counter()
        for _ in range(n):
            conn.execute(
                "INSERT INTO bench_naive_timer (fire_at, handler) VALUES (%s, 'noop')", [at]
            )
        return time.perf_counter() - started


def insert_executemany(url: str, due_ms: Sequence[float], handler: str = "noop") -> float:
    """``executemany`` of INSERTs in one transaction (psycopg pipelines it)."""
    rows = [(_dt(ms), handler, f'{{"ref": {i}}}') for i, ms in enumerate(due_ms)]
    with connect(url, autocommit=False) as conn:
        started = time.perf_counter()
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO bench_naive_timer (fire_at, handler, args) VALUES (%s, %s, %s)", rows
            )
        conn.commit()
        return time.perf_counter() - started


def insert_copy(url: str, due_ms: Sequence[float], handler: str = "noop") -> float:
    """COPY the rows in one transaction; return the seconds."""
    with connect(url, autocommit=False) as conn:
        started = time.perf_counter()
        with (
            conn.cursor() as cur,
            cur.copy("COPY bench_naive_timer (fire_at, handler, args) FROM STDIN") as copy,
        ):
            for i, ms in enumerate(due_ms):
                copy.write_row((_dt(ms), handler, f'{{"ref": {i}}}'))
        conn.commit()
        return time.perf_counter() - started


def insert_far(url: str, n: int, days: float = 30) -> float:
    """``n`` rows ``days`` out with generate_series (the 1M-pending set-up)."""
    with connect(url) as conn:
        started = time.perf_counter()
        conn.execute(
            "INSERT INTO bench_naive_timer (fire_at, handler) "
            "SELECT now() + make_interval(days => %s) + i * interval '1 ms', 'noop' "
            "FROM generate_series(1, %s) AS i",
            [days, n],
        )
        conn.execute("ANALYZE bench_naive_timer")
        return time.perf_counter() - started


class Poller:
    """The polling loop in a thread, with the two benchmark handlers."""

    def __init__(self, url: str, *, poll_s: float = POLL_S, limit: int = LIMIT) -> None:
        self.url = url
        self.poll_s = poll_s
        self.limit = limit
        self.stop_event = threading.Event()
        self.fired = 0
        self.thread = threading.Thread(target=self._run, name="naive-poller", daemon=True)

    def start(self) -> None:
        """Start polling."""
        self.thread.start()

    def stop(self) -> None:
        """Finish the current turn and stop."""
        self.stop_event.set()
        self.thread.join(timeout=60)

    def _run(self) -> None:
        with connect(self.url, autocommit=False) as conn:
            while not self.stop_event.is_set():
                got = self._turn(conn)
                if got < self.limit:
                    self.stop_event.wait(self.poll_s)

    def _turn(self, conn: Any) -> int:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT id, extract(epoch FROM fire_at) * 1000, handler, args "
                "FROM bench_naive_timer WHERE state = 'pending' AND fire_at <= now() "
                "ORDER BY fire_at LIMIT %s FOR UPDATE SKIP LOCKED",
                [self.limit],
            )
            rows = cur.fetchall()
            for timer_id, due_ms, handler, args in rows:
                fired = wall_ms()
                if handler == "write":
                    cur.execute(
                        "INSERT INTO bench_effect (ref, due_ms, fired_ms) VALUES (%s, %s, %s)",
                        [args.get("ref", timer_id), int(due_ms), fired],
                    )
                RECORDER.events.append((float(due_ms), fired))
            if rows:
                cur.execute(
                    "UPDATE bench_naive_timer SET state = 'done', fired_at = now() "
                    "WHERE id = ANY(%s)",
                    [[r[0] for r in rows]],
                )
        conn.commit()
        self.fired += len(rows)
        return len(rows)
