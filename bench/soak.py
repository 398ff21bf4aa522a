"""Soak: one worker, 64 shards, a steady stream of fires over millions of pending timers.

    python bench/soak.py                 # the hour: 5M pending, 5,000 fires/s, retention 10 min
    python bench/soak.py --quick         # 5 min: 200k pending, 1,000 fires/s, retention 1 min
    python bench/soak.py --quick --out /tmp/soak   # where the JSON and the PNG go
    python bench/soak.py --quick --cluster         # on a throwaway production-like server

What runs: database ``durable_soak`` (``SOAK_DB`` names another), dropped, created and
migrated at each start, on the shared server (127.0.0.1:5432) or, with ``--cluster``, on
a throwaway PostgreSQL cluster of its own (``durable.testing.cluster``: ``initdb`` in a
temporary directory, run as the ``postgres`` OS user, so as root; port from
``SOAK_CLUSTER_PORT``, 26000 by default, up; always destroyed at the end) with the
settings of a production server: ``autovacuum`` on with its defaults, ``fsync`` and
``synchronous_commit`` on, every autovacuum logged (``log_autovacuum_min_duration=0``,
the log's lines on ``durable_timer`` counted into the JSON); ``--pending`` timers 30
days out (never due in the run) inserted with one set-based ``INSERT ... SELECT
generate_series``; one real ``manage.py run_timer_shards`` worker (the test project's
settings: 64 shards, ``DEBUG`` off) with ``RETENTION_DAYS`` shortened to
``--retention-s`` (``DURABLE_RETENTION_DAYS``), so that its pruning runs throughout; and
a producer thread calling ``durable.schedule_many`` ten times a second with
``--rate``/10 no-op timers due 1.5 s ahead, as an application would.

Every ``--interval-s`` (60 s; 10 s in ``--quick``) one row: the lateness p50/p99/max of
the fires stamped in that interval (``fired_at - fire_at_ms`` of the rows: the batch's
stamp, so the figure leaves out the handler itself), fires/s achieved, timers produced,
overdue pending timers, rows fired and kept, rows pruned (the worker's ``timers.pruned``
log lines), the heap, index and total sizes of ``durable_timer`` and of every
``durable_*`` table, ``n_dead_tup``, the vacuum and autovacuum counts of
``pg_stat_user_tables`` with the time of the last autovacuum, the worker's RSS and the
load average. The row of interval k is read 3 s after it ends, so its batches have
committed; the worker prunes rows only ``--retention-s`` after they fired, so they are all
still there.

Vacuum: the figures mean little without it. When the server runs autovacuum, the soak
leaves vacuuming to it. When it does not (``autovacuum = off``, as on some shared test
servers), the soak says so and runs ``VACUUM durable_timer`` itself every
``--vacuum-every-s`` (default 60 s then; 0 never), a stand-in for autovacuum that the
table counts as ``vacuum_count``. ``--cluster`` runs autovacuum, so no manual VACUUM.

Output: the table as it goes, a JSON file (``soak.json``) and a plot (``soak.png``:
lateness and sizes per interval) in ``--out``. The verdicts at the end: the worst
interval p99 against 25 ms, and the growth of the table + index size from the first
interval past retention (plus one pruning period) to the last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import REPO, Lateness, connect, wall_ms

#: ``SOAK_DB`` names another database (one per person benching on the server).
DB = os.environ.get("SOAK_DB", "durable_soak")
#: The shared server's; ``--cluster`` points it at the throwaway cluster's database.
URL = "postgres://durable:durable@127.0.0.1:5432/" + DB
#: ``--cluster``: the first port tried (each person benching on a machine can move it).
CLUSTER_PORT = int(os.environ.get("SOAK_CLUSTER_PORT", "26000"))
#: ``--cluster``: a production server's durability and vacuuming (autovacuum's own
#: defaults otherwise), and every autovacuum in the server log.
CLUSTER_OPTIONS = (
    "-c fsync=on -c synchronous_commit=on -c autovacuum=on -c log_autovacuum_min_duration=0"
)
#: How far ahead the producer schedules each timer, and how often it writes a batch.
LEAD_MS = 1_500
TICK_S = 0.1
#: An interval's row is read this long after it ends: its batches have committed.
SETTLE_S = 3.0
#: The worker's pruning pass comes once a minute (``durable.worker.chores.PRUNE_EVERY_MS``).
PRUNE_PERIOD_S = 60.0
P99_TARGET_MS = 25.0


@dataclass(frozen=True, slots=True)
class Plan:
    """How big and how long a soak runs."""

    minutes: float
    pending: int
    rate: int
    retention_s: float
    interval_s: float
    vacuum_every_s: float | None  # None: decided from the server's autovacuum setting
    cluster: bool = False  # on a throwaway production-like cluster, not the shared server


FULL = Plan(minutes=60, pending=5_000_000, rate=5_000, retention_s=600, interval_s=60,
            vacuum_every_s=None)  # fmt: skip
QUICK = Plan(minutes=5, pending=200_000, rate=1_000, retention_s=60, interval_s=10,
             vacuum_every_s=None)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> tuple[Plan, Path]:
    """The plan (``--quick`` or the full hour, each size overridable) and the output folder."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 min, 200k pending, 1,000/s")
    parser.add_argument("--minutes", type=float, help="how long the stream runs")
    parser.add_argument("--pending", type=int, help="timers pending 30 days out")
    parser.add_argument("--rate", type=int, help="fires a second coming due")
    parser.add_argument("--retention-s", type=float, help="RETENTION_DAYS, in seconds")
    parser.add_argument("--interval-s", type=float, help="seconds per table row")
    parser.add_argument(
        "--vacuum-every-s",
        type=float,
        help="run VACUUM durable_timer this often (0: never); default: 60 when the"
        " server's autovacuum is off, else never",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run on a throwaway cluster (autovacuum, fsync, synchronous_commit on); needs root",
    )
    parser.add_argument("--out", type=Path, default=Path("/tmp/soak"), help="JSON and PNG here")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    overrides = {
        name: getattr(args, name)
        for name in ("minutes", "pending", "rate", "retention_s", "interval_s", "vacuum_every_s")
        if getattr(args, name) is not None
    }
    overrides["cluster"] = args.cluster
    plan = Plan(**{**asdict(base), **overrides})
    if plan.rate <= 0 or plan.minutes <= 0 or plan.interval_s <= 0 or plan.pending < 0:
        parser.error("--rate, --minutes and --interval-s must be positive, --pending >= 0")
    if plan.retention_s <= 0:
        parser.error("--retention-s must be positive")
    return plan, args.out


# --- one interval's row (pure: tested in tests/unit/test_bench_soak.py) ----------------------


@dataclass(slots=True)
class Interval:
    """One row of the table: what happened in ``[start_s, end_s)`` of the stream."""

    index: int
    start_s: float
    end_s: float
    fires: int
    fires_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    produced: int
    overdue: int
    kept_fired: int
    pruned: int
    heap_mb: float
    index_mb: float
    timer_total_mb: float
    all_tables_mb: float
    dead_tuples: int
    vacuums: int
    autovacuums: int
    rss_mb: float
    load: str
    last_autovacuum: str = "-"  # HH:MM:SS (UTC) of durable_timer's last autovacuum
    extra: dict[str, Any] = field(default_factory=dict)


def aggregate(
    index: int,
    start_s: float,
    end_s: float,
    samples: list[float],
    *,
    produced: int,
    pruned: int,
    stats: dict[str, Any],
    rss_mb: float,
    load: str,
) -> Interval:
    """The row of one interval from its lateness samples (ms) and the database's figures."""
    lat = Lateness.of(samples)
    mb = 2**20
    return Interval(
        index=index,
        start_s=start_s,
        end_s=end_s,
        fires=lat.n,
        fires_per_s=lat.n / (end_s - start_s) if end_s > start_s else 0.0,
        p50_ms=lat.p50,
        p99_ms=lat.p99,
        max_ms=lat.max,
        produced=produced,
        overdue=int(stats["overdue"]),
        kept_fired=int(stats["kept_fired"]),
        pruned=pruned,
        heap_mb=stats["heap_bytes"] / mb,
        index_mb=stats["index_bytes"] / mb,
        timer_total_mb=(stats["heap_bytes"] + stats["index_bytes"] + stats["toast_bytes"]) / mb,
        all_tables_mb=stats["all_bytes"] / mb,
        dead_tuples=int(stats["dead"]),
        vacuums=int(stats["vacuums"]),
        autovacuums=int(stats["autovacuums"]),
        rss_mb=rss_mb,
        load=load,
        last_autovacuum=stats.get("last_autovacuum") or "-",
    )


COLUMNS = (
    ("t (s)", lambda r: f"{r.end_s:.0f}"),
    ("fires/s", lambda r: f"{r.fires_per_s:,.0f}"),
    ("p50 ms", lambda r: f"{r.p50_ms:.1f}"),
    ("p99 ms", lambda r: f"{r.p99_ms:.1f}"),
    ("max ms", lambda r: f"{r.max_ms:.1f}"),
    ("overdue", lambda r: f"{r.overdue:,}"),
    ("fired kept", lambda r: f"{r.kept_fired:,}"),
    ("pruned", lambda r: f"{r.pruned:,}"),
    ("timer heap MB", lambda r: f"{r.heap_mb:.1f}"),
    ("timer idx MB", lambda r: f"{r.index_mb:.1f}"),
    ("durable_* MB", lambda r: f"{r.all_tables_mb:.1f}"),
    ("dead tup", lambda r: f"{r.dead_tuples:,}"),
    ("vac/autovac", lambda r: f"{r.vacuums}/{r.autovacuums}"),
    ("last autovac", lambda r: r.last_autovacuum),
    ("RSS MB", lambda r: f"{r.rss_mb:.0f}"),
    ("load 1m", lambda r: r.load),
)


def header() -> str:
    """The markdown table's head."""
    names = [name for name, _ in COLUMNS]
    return "| " + " | ".join(names) + " |\n|" + "---:|" * len(names)


def render(row: Interval) -> str:
    """One markdown table line."""
    return "| " + " | ".join(cell(row) for _, cell in COLUMNS) + " |"


def verdicts(rows: list[Interval], plan: Plan) -> dict[str, Any]:
    """Worst interval p99 against the target; size growth once retention is reached.

    "Reached": the first interval ending at least ``retention + one pruning period`` into
    the stream (rows older than retention exist and a pass has run on them); the growth
    is the timer table + indexes there against the last interval.
    """
    measured = [r for r in rows if r.fires]
    worst = max((r.p99_ms for r in measured), default=float("nan"))
    steady = [r for r in rows if r.end_s >= plan.retention_s + PRUNE_PERIOD_S]
    out: dict[str, Any] = {
        "worst_interval_p99_ms": worst,
        "p99_target_ms": P99_TARGET_MS,
        "p99_hit": bool(measured) and worst <= P99_TARGET_MS,
        "worst_interval_max_ms": max((r.max_ms for r in measured), default=float("nan")),
        "fires": sum(r.fires for r in rows),
        "produced": sum(r.produced for r in rows),
    }
    if len(steady) >= 2:
        first, last = steady[0], steady[-1]
        out["size_from_mb"] = round(first.timer_total_mb, 1)
        out["size_to_mb"] = round(last.timer_total_mb, 1)
        out["size_growth_pct"] = round(
            100 * (last.timer_total_mb - first.timer_total_mb) / first.timer_total_mb, 1
        )
        out["kept_fired_from"] = first.kept_fired
        out["kept_fired_to"] = last.kept_fired
    else:
        out["size_growth_pct"] = None  # the run ended before retention was reached
    return out


# --- the database -------------------------------------------------------------------------


def load() -> str:
    """The 1-minute load average."""
    return Path("/proc/loadavg").read_text().split()[0]


def recreate_database() -> None:
    """Drop, create and migrate the soak's own database."""
    name = URL.rsplit("/", 1)[1]
    with connect(URL.rsplit("/", 1)[0] + "/postgres") as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    env = {**os.environ, "DATABASE_URL": URL, "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    migrate = [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"]
    subprocess.run(migrate, cwd=REPO, env=env, check=True)


def preload(n: int) -> float:
    """``n`` pending no-op timers 30 days out over one day: one set-based INSERT."""
    from bench.peers.durable_side import raw, sql_insert
    from bench.peers.soak_side import IDLE

    started = time.monotonic()
    if n:
        sql_insert(n, int(wall_ms()) + 30 * 86_400_000, 86_400_000 / n, target=IDLE)
    raw("VACUUM ANALYZE durable_timer")
    return time.monotonic() - started


STATS_SQL = """
SELECT pg_relation_size('durable_timer'), pg_indexes_size('durable_timer'),
       pg_total_relation_size('durable_timer') - pg_relation_size('durable_timer')
         - pg_indexes_size('durable_timer'),
       (SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind = 'r' AND n.nspname = 'public' AND c.relname LIKE 'durable\\_%%'),
       s.n_dead_tup, s.vacuum_count, s.autovacuum_count,
       to_char(s.last_autovacuum AT TIME ZONE 'UTC', 'HH24:MI:SS'),
       (SELECT count(*) FROM durable_timer WHERE state IN ('fired', 'canceled')),
       (SELECT count(*) FROM durable_timer WHERE state = 'pending'
          AND fire_at_ms < %s)
FROM pg_stat_user_tables s WHERE s.relname = 'durable_timer'
"""

LATENESS_SQL = """
SELECT extract(epoch FROM fired_at) * 1000 - fire_at_ms FROM durable_timer
WHERE state = 'fired' AND updated_at >= %s AND updated_at < %s
  AND fired_at >= %s AND fired_at < %s
"""


def stats(conn: Any) -> dict[str, Any]:
    """Sizes, dead tuples, vacuum counts, kept fired rows, pending timers overdue by 1 s."""
    row = conn.execute(STATS_SQL, [int(wall_ms()) - 1_000]).fetchone()
    keys = ("heap_bytes", "index_bytes", "toast_bytes", "all_bytes", "dead", "vacuums",
            "autovacuums", "last_autovacuum", "kept_fired", "overdue")  # fmt: skip
    return {k: (v if v is not None else 0) for k, v in zip(keys, row, strict=True)}


def lateness_samples(conn: Any, start_ms: float, end_ms: float) -> list[float]:
    """Lateness (ms) of the rows whose batch stamped them fired in ``[start_ms, end_ms)``."""
    from datetime import UTC, datetime

    def dt(ms: float) -> datetime:
        return datetime.fromtimestamp(ms / 1000, tz=UTC)

    # updated_at is the same stamp (the fired rows' index); a little slack either side.
    params = [dt(start_ms - 5_000), dt(end_ms + 5_000), dt(start_ms), dt(end_ms)]
    return [float(v) for (v,) in conn.execute(LATENESS_SQL, params).fetchall()]


# --- the producer and the worker's log ------------------------------------------------------


class Producer(threading.Thread):
    """``durable.schedule_many`` every 100 ms: ``rate/10`` timers due ``LEAD_MS`` later."""

    def __init__(self, rate: int, until_ms: float) -> None:
        super().__init__(name="soak-producer", daemon=True)
        self.rate = rate
        self.until_ms = until_ms
        self.produced = 0
        self.behind_ticks = 0  # ticks written after their own due window had begun
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def stop(self) -> None:
        """Stop after the current batch."""
        self._halt.set()

    def run(self) -> None:
        from django.db import connections

        try:
            self._loop()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            connections.close_all()

    def _loop(self) -> None:
        import durable
        from bench.peers.durable_side import to_dt
        from bench.peers.soak_side import IDLE

        tick_ms = TICK_S * 1000
        per_tick = self.rate * TICK_S
        next_ms = wall_ms()
        carry = 0.0
        while not self._halt.is_set() and next_ms < self.until_ms:
            now = wall_ms()
            if now < next_ms:
                time.sleep((next_ms - now) / 1000)
                continue
            carry += per_tick
            n, carry = int(carry), carry - int(carry)
            first = next_ms + LEAD_MS
            if wall_ms() > first:
                self.behind_ticks += 1
            specs = [{"fn": IDLE, "at": to_dt(first + i * tick_ms / n)} for i in range(n)]
            if specs:
                durable.schedule_many(specs)
            self.produced += n
            next_ms += tick_ms


class PruneLog:
    """Sums the rows of the worker's ``timers.pruned`` log lines written since the last read."""

    PATTERN = re.compile(r"timers\.pruned.*?\brows[=\"': ]+(\d+)")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> int:
        """Rows pruned in the lines logged since the last call."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offset += end
        return sum(int(m) for m in self.PATTERN.findall(chunk[:end].decode(errors="replace")))


# --- the run --------------------------------------------------------------------------------


def server_autovacuum() -> str:
    """The server's ``autovacuum`` setting (``on``/``off``)."""
    with connect(URL) as conn:
        return str(conn.execute("SHOW autovacuum").fetchone()[0])


def environment() -> dict[str, Any]:
    """What the figures were measured on."""
    import platform

    import psutil

    with connect(URL) as conn:
        settings = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('server_version',"
                " 'synchronous_commit', 'fsync', 'shared_buffers', 'autovacuum',"
                " 'autovacuum_naptime', 'autovacuum_vacuum_scale_factor',"
                " 'autovacuum_vacuum_threshold', 'autovacuum_vacuum_insert_scale_factor',"
                " 'autovacuum_vacuum_cost_delay', 'autovacuum_vacuum_cost_limit')"
            ).fetchall()
        )
    return {
        "platform": platform.platform(),
        "cpus": psutil.cpu_count(),
        "python": platform.python_version(),
        "postgres": settings,
        "load_at_start": Path("/proc/loadavg").read_text().strip(),
    }


AUTOVACUUM_LINE = re.compile(r'automatic vacuum of table "[^"]*\.public\.durable_timer"')


def run(plan: Plan, out: Path) -> dict[str, Any]:
    """The whole soak (on a throwaway cluster with ``--cluster``); what ``soak.json`` holds."""
    global URL
    if not plan.cluster:
        return run_on_server(plan, out)
    from durable.testing.cluster import TemporaryCluster, free_port

    cluster = TemporaryCluster(port=free_port(CLUSTER_PORT), options=CLUSTER_OPTIONS)
    try:
        cluster.start()
        URL = cluster.url(DB)
        print(f"throwaway cluster on port {cluster.port}: {CLUSTER_OPTIONS}", flush=True)
        result = run_on_server(plan, out)
        log = cluster.server_log()
        result["autovacuums_logged"] = len(AUTOVACUUM_LINE.findall(log))
        (out / "server.log").write_text(log)
        (out / "soak.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        return result
    finally:
        cluster.destroy()


def run_on_server(plan: Plan, out: Path) -> dict[str, Any]:
    """The whole soak on the server of ``URL``; returns what ``soak.json`` holds."""
    import psutil

    from bench._common import setup_django
    from bench._worker_proc import WorkerProcess

    out.mkdir(parents=True, exist_ok=True)
    print(f"plan: {plan}", flush=True)
    recreate_database()
    setup_django(URL, DJANGO_DEBUG="false", DURABLE_IMPORTS="bench.peers.soak_side")
    from durable.conf import get_settings

    shards = get_settings().SHARDS
    autovacuum = server_autovacuum()
    vacuum_every = plan.vacuum_every_s
    if vacuum_every is None:
        vacuum_every = 60.0 if autovacuum == "off" else 0.0
    env = environment()
    env["vacuum"] = (
        f"server autovacuum={autovacuum}; the soak runs VACUUM durable_timer every"
        f" {vacuum_every:.0f} s"
        if vacuum_every
        else f"server autovacuum={autovacuum}; no manual VACUUM"
    )
    print(json.dumps(env), flush=True)
    took = preload(plan.pending)
    print(f"pre-loaded {plan.pending:,} pending timers in {took:.0f} s", flush=True)

    retention_days = plan.retention_s / 86_400
    worker = WorkerProcess(
        URL,
        "soak-w1",
        DURABLE_IMPORTS="bench.peers.soak_side",
        DURABLE_RETENTION_DAYS=repr(retention_days),
    )
    rows: list[Interval] = []
    producer: Producer | None = None
    try:
        ready = worker.wait_owning(shards, timeout_s=180)
        print(f"worker holds {shards} shards after {ready:.1f} s", flush=True)
        proc = psutil.Process(worker.pid)
        # Intervals count from the first timer's due time (the producer writes LEAD_MS ahead).
        producer = Producer(plan.rate, wall_ms() + plan.minutes * 60_000)
        producer.start()
        started_ms = wall_ms() + LEAD_MS
        end_ms = started_ms + plan.minutes * 60_000
        prunes = PruneLog(Path(worker.log.name))
        prunes.read()  # start-up lines
        produced_before = 0
        next_vacuum_ms = started_ms + vacuum_every * 1000 if vacuum_every else float("inf")
        print(header(), flush=True)
        with connect(URL) as conn:
            k = 0
            while started_ms + (k + 1) * plan.interval_s * 1000 <= end_ms:
                lo = started_ms + k * plan.interval_s * 1000
                hi = lo + plan.interval_s * 1000
                while wall_ms() < hi + SETTLE_S * 1000:
                    if wall_ms() >= next_vacuum_ms:
                        conn.execute("VACUUM durable_timer")
                        next_vacuum_ms += vacuum_every * 1000
                    time.sleep(0.2)
                    if worker.proc.poll() is not None:
                        raise RuntimeError(f"the worker exited: see {worker.log.name}")
                    if producer.error is not None:
                        raise RuntimeError(f"the producer failed: {producer.error!r}")
                produced = producer.produced
                row = aggregate(
                    k,
                    (lo - started_ms) / 1000,
                    (hi - started_ms) / 1000,
                    lateness_samples(conn, lo, hi),
                    produced=produced - produced_before,
                    pruned=prunes.read(),
                    stats=stats(conn),
                    rss_mb=proc.memory_info().rss / 2**20,
                    load=load(),
                )
                produced_before = produced
                rows.append(row)
                print(render(row), flush=True)
                k += 1
        producer.stop()
        producer.join(timeout=30)
    finally:
        if producer is not None:
            producer.stop()
        worker.stop()
    result = {
        "plan": asdict(plan),
        "environment": env,
        "worker_ready_s": round(ready, 1),
        "producer_behind_ticks": producer.behind_ticks if producer else None,
        "intervals": [asdict(r) for r in rows],
        "verdicts": verdicts(rows, plan),
        "worker_log": worker.log.name,
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    plot(rows, plan, out / "soak.png")
    return result


def plot(rows: list[Interval], plan: Plan, path: Path) -> None:
    """Lateness p50/p99/max and the sizes per interval, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.end_s / 60 for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    top.plot(t, [r.p50_ms for r in rows], label="p50")
    top.plot(t, [r.p99_ms for r in rows], label="p99")
    top.plot(t, [r.max_ms for r in rows], label="max", linestyle=":")
    top.axhline(P99_TARGET_MS, color="grey", linewidth=0.8, label="p99 target")
    top.set_yscale("log")
    top.set_ylabel("lateness per interval (ms)")
    top.legend(loc="upper left")
    top.set_title(
        f"soak: {plan.pending:,} pending, {plan.rate:,} fires/s, retention"
        f" {plan.retention_s:.0f} s, 1 worker"
    )
    bottom.plot(t, [r.heap_mb for r in rows], label="durable_timer heap")
    bottom.plot(t, [r.index_mb for r in rows], label="durable_timer indexes")
    bottom.plot(t, [r.all_tables_mb for r in rows], label="all durable_* tables")
    bottom.set_ylabel("MB")
    bottom.set_xlabel("minutes into the stream")
    dead = bottom.twinx()
    dead.plot(t, [r.dead_tuples for r in rows], color="grey", linestyle="--", label="dead tuples")
    dead.set_ylabel("dead tuples (timer table)")
    lines = bottom.get_legend_handles_labels()
    more = dead.get_legend_handles_labels()
    bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    plan, out = parse_args(argv)
    result = run(plan, out)
    print(json.dumps(result["verdicts"], indent=1))
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
