"""Shared plumbing of ``bench/timers.py``: Django set-up, connections, statistics, the table.

Kept free of any contender's logic: each contender lives in ``bench/peers/``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Overridable, so that runs sharing one server (two trees compared, several sessions)
# each use databases of their own.
DURABLE_URL = os.environ.get(
    "DURABLE_BENCH_URL", "postgres://durable:durable@127.0.0.1:5432/durable_bench"
)
PROCRASTINATE_URL = os.environ.get(
    "DURABLE_BENCH_PROCRASTINATE_URL",
    "postgres://durable:durable@127.0.0.1:5432/durable_bench_procrastinate",
)


def setup_django(database_url: str, **env: str) -> None:
    """Point the test project at ``database_url`` and set Django up (once per process)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    os.environ.setdefault("DURABLE_LOG_LEVEL", "WARNING")
    os.environ.update(env)
    import django

    django.setup()


def wall_ms() -> float:
    """Wall-clock time in (fractional) epoch milliseconds: what lateness is measured with."""
    return time.time_ns() / 1_000_000


def connect(url: str, *, autocommit: bool = True) -> Any:
    """A plain psycopg 3 connection (the peers' and the bench's own queries)."""
    import psycopg

    return psycopg.connect(url, autocommit=autocommit)


def server_health(url: str) -> str:
    """What on the PostgreSQL server behind ``url`` can skew a lateness figure, in a line.

    Read before and after a run, so that a figure out of line with earlier ones can be told
    from a server in trouble: a full NOTIFY queue (a listener that stopped reading, say a
    frozen process left over by a test), the oldest transaction's age (an idle-in-transaction
    session or a replication slot that holds dead rows back; the shared server here runs
    without autovacuum), and how many other sessions are busy (state and age are seen only
    for the sessions of the bench's own role, unless it has ``pg_read_all_stats``).
    """
    with connect(url) as conn:
        queue, sessions, busy, oldest_s, slots = conn.execute(
            "SELECT pg_notification_queue_usage(), count(*), "
            "count(*) FILTER (WHERE state <> 'idle'), "
            "coalesce(max(extract(epoch FROM now() - xact_start)), 0), "
            "(SELECT count(*) FROM pg_replication_slots) "
            "FROM pg_stat_activity WHERE backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()"
        ).fetchone()
    return (
        f"NOTIFY queue {queue:.1%} full; {sessions} other client sessions, {busy} not idle; "
        f"oldest open transaction {oldest_s:.0f} s; {slots} replication slots"
    )


def wait_until(predicate: Callable[[], bool], timeout_s: float, every_s: float = 0.005) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; return whether it held."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return predicate()


def quiet_gc() -> None:
    """Collect now, so a collection of the previous section's garbage does not land in a timing."""
    gc.collect()


# --- statistics ------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass(frozen=True, slots=True)
class Lateness:
    """Lateness summary in ms (fired - due)."""

    n: int
    p50: float
    p99: float
    max: float
    min: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Lateness:
        """Summarise a list of lateness samples."""
        if not values:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan)
        ordered = sorted(values)
        return cls(
            len(ordered),
            percentile(ordered, 50),
            percentile(ordered, 99),
            ordered[-1],
            ordered[0],
        )

    def __str__(self) -> str:
        return f"p50 {self.p50:.1f} / p99 {self.p99:.1f} / max {self.max:.1f} ms (n={self.n})"


def median(values: Iterable[float]) -> float:
    """Median that tolerates an empty input (NaN)."""
    values = list(values)
    return statistics.median(values) if values else float("nan")


class Recorder:
    """``(due_ms, fired_ms)`` pairs appended by handlers, from any thread (append is atomic)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float]] = []

    def reset(self) -> None:
        """Forget every event."""
        self.events = []

    def __len__(self) -> int:
        return len(self.events)

    @property
    def samples(self) -> list[float]:
        """Lateness of every fire, ms."""
        return [fired - due for due, fired in self.events]

    def fired_by(self, deadline_ms: float) -> int:
        """How many fired at or before ``deadline_ms``."""
        return sum(1 for _, fired in self.events if fired <= deadline_ms)


# --- the report ------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    """One line of the final table."""

    section: str
    metric: str
    durable: str
    procrastinate: str = "-"
    naive: str = "-"
    ratios: str = "-"
    target: str = ""
    verdict: str = ""


@dataclass(slots=True)
class Report:
    """Every figure of a run, printed as one table at the end."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, row: Row) -> None:
        """Add a row and echo it at once (a long run shows progress)."""
        with self.lock:
            self.rows.append(row)
        print(
            f"  -> {row.section} | {row.metric}: durable {row.durable}"
            f" | procrastinate {row.procrastinate} | naive {row.naive}"
            f"{' | ' + row.ratios if row.ratios != '-' else ''}"
            f"{' | target ' + row.target + ' ' + row.verdict if row.target else ''}",
            flush=True,
        )

    def note(self, text: str) -> None:
        """A line printed under the table."""
        self.notes.append(text)

    def render(self) -> str:
        """The table as GitHub markdown (what docs/benchmarks.md takes)."""
        head = [
            "section",
            "metric",
            "durable",
            "procrastinate",
            "naive poller",
            "durable / peer",
            "target",
            "hit?",
        ]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            cells = [
                r.section,
                r.metric,
                r.durable,
                r.procrastinate,
                r.naive,
                r.ratios,
                r.target,
                r.verdict,
            ]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines)


def rate(n: int, seconds: float) -> float:
    """Items per second (0 when nothing was timed)."""
    return n / seconds if seconds > 0 else 0.0


def fmt_rate(value: float) -> str:
    """``12,345/s``."""
    return f"{value:,.0f}/s" if value == value else "n/a"


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``12.3x`` (or ``n/a``)."""
    if not b or a != a or b != b:
        return "n/a"
    return f"{a / b:,.1f}x"


def hit(ok: bool) -> str:
    """The verdict cell."""
    return "HIT" if ok else "MISS"
