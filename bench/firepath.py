"""Profile of the fire path: statements, planning and execution time per fired timer.

    python bench/firepath.py                    # prepared (prepare_threshold 5), then unprepared
    python bench/firepath.py --only unprepared  # one mode
    python bench/firepath.py --seconds 10 --rate 2000 --markdown out.md

The workload of ``bench/pgbouncer.py --preload`` (timers written first by
``schedule_many``, due at ``--rate`` a second from 8 s after, each fire's handler writing
one row), against a throwaway PostgreSQL cluster (``durable.testing.cluster``, run as
the ``postgres`` OS user, so as root) started with ``pg_stat_statements`` preloaded and
``track_planning`` on, ``fsync`` and ``synchronous_commit`` on. The statistics are reset
once the timers are written, before the first is due, and read when every timer has
fired: they hold the worker's statements (and the bench handler's ``INSERT``), with
``BEGIN`` and ``COMMIT``. For each statement: calls per batch (a batch is one lock of
due rows) and per fired timer, the share of calls the server planned (prepared
statements are planned once, or kept on custom plans), and the mean planning (per plan)
and execution time (per call) the server measured. "unprepared" runs the worker with the
settings of a pooled database (``DURABLE_LISTEN_DATABASE_URL`` set, so no
``prepare_threshold`` and the worker not preparing), as behind PgBouncer 1.18;
"pgbouncer" the same through a PgBouncer in transaction mode in front of the cluster.
The worker process's CPU per fired timer is read with psutil.

Round trips per fired timer are the calls of all statements (each statement, ``BEGIN``
and ``COMMIT`` included, is one round trip from the worker). Times are per call, in ms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import REPO, Lateness, connect, wait_until

DB = "durable_firepath_bench"
MODES = ("prepared", "unprepared", "pgbouncer")


def start_cluster() -> tuple[object, str]:
    """A throwaway cluster with pg_stat_statements, and the URL of a migrated database."""
    from durable.testing.cluster import TemporaryCluster

    cluster = TemporaryCluster(
        options="-c shared_preload_libraries=pg_stat_statements "
        "-c pg_stat_statements.track_planning=on -c pg_stat_statements.track=all "
        "-c pg_stat_statements.max=5000 -c fsync=on -c synchronous_commit=on "
        "-c max_connections=50"
    )
    cluster.start()
    url = cluster.create_database(DB)
    cluster.query(DB, "CREATE EXTENSION pg_stat_statements")
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=REPO,
        env=env,
        check=True,
    )
    return cluster, url


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its children so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def profile(
    url: str, mode: str, seconds: float, rate: int, pooled: str | None = None
) -> tuple[list[str], Lateness]:
    """One mode: preload, reset the statistics, let the worker fire everything, read them.

    ``pooled``: the worker's URL through PgBouncer (mode "pgbouncer"; it listens on ``url``).
    """
    from bench._worker_proc import WorkerProcess
    from bench.peers.durable_side import EFFECT_DDL

    with connect(url) as conn:
        conn.execute(EFFECT_DDL)
        conn.execute("TRUNCATE durable_timer, durable_workernode, bench_effect CASCADE")
        conn.execute("UPDATE durable_shardlease SET owner = '', expires_at = NULL, cursor_ms = 0")
        conn.execute("VACUUM ANALYZE durable_timer")
    extra = {"DURABLE_LISTEN_DATABASE_URL": url} if mode != "prepared" else {}
    worker = WorkerProcess(pooled or url, f"firepath-{mode}", **extra)
    try:
        worker.wait_owning(64)
        time.sleep(2.0)
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DJANGO_DEBUG": "false",
            **extra,
        }
        command = [sys.executable, "bench/pgbouncer.py", "--preload", str(seconds), str(rate)]
        out = subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
        total = int(out.stdout.split()[0])
        with connect(url) as conn:
            conn.execute("SELECT pg_stat_statements_reset()")
            cpu_before = cpu_s(worker.pid)
            wait_until(
                lambda: conn.execute("SELECT count(*) FROM bench_effect").fetchone()[0] >= total,
                timeout_s=90 + seconds,
                every_s=0.5,
            )
            worker_cpu_ms = (cpu_s(worker.pid) - cpu_before) * 1000
            lateness = Lateness.of(
                [float(r[0]) for r in conn.execute("SELECT fired_ms - due_ms FROM bench_effect")]
            )
            rows = conn.execute(
                "SELECT calls, total_plan_time, total_exec_time, plans, query "
                "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
                "WHERE datname = current_database()) AND query NOT LIKE '%%pg_stat_statements%%' "
                "AND query NOT LIKE '%%FROM bench_effect%%' ORDER BY calls DESC"
            ).fetchall()
    finally:
        worker.stop()
    calls = sum(r[0] for r in rows)
    plan = sum(r[1] for r in rows)
    execute = sum(r[2] for r in rows)
    # A batch is one lock of its due rows (the statement that locks durable_timer rows).
    batches = sum(r[0] for r in rows if "FOR UPDATE OF durable_timer" in r[4]) or 1
    handler = sum(r[0] for r in rows if "bench_effect" in r[4])
    lines = [
        f"### {mode}: {total:,} timers at {rate:,}/s; lateness {lateness}",
        "",
        f"{batches:,} batches ({total / batches:.1f} timers each); {calls / total:.2f} "
        f"statements (round trips) per fired timer, of which the handler's {handler / total:.2f}; "
        f"{(calls - handler) / batches:.1f} of durable's per batch (rescans and renewals "
        f"included); server time per fired timer: planning {plan / total:.3f} ms, execution "
        f"{execute / total:.3f} ms; the worker process's CPU {worker_cpu_ms / total:.3f} ms "
        "per fired timer (from the statistics' reset to the last fire)",
        "",
        "| calls | per batch | per timer | planned (share of calls) | plan ms | exec ms "
        "| statement |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, plan_ms, exec_ms, plans, query in rows:
        if n / total < 0.005 and n / batches < 0.5:
            continue
        text = " ".join(query.split())
        text = text if len(text) <= 110 else text[:107] + "..."
        mean_plan = plan_ms / plans if plans else 0.0
        lines.append(
            f"| {n:,} | {n / batches:.2f} | {n / total:.3f} | {plans / n:.2f} | {mean_plan:.3f} "
            f"| {exec_ms / n:.3f} | `{text.replace('|', '/')}` |"
        )
    return lines, lateness


def hop(direct: str, pooled: str, trips: int = 2_000, reps: int = 5) -> list[str]:
    """Round trip of a one-row INSERT in a transaction (what the bench handler does once a
    fire) and of a SELECT, direct and through the pooler: the median of ``reps``
    alternating runs of ``trips`` each, in microseconds."""
    import statistics

    from bench.peers.durable_side import EFFECT_DDL

    urls = {"direct": direct, "PgBouncer, transaction mode": pooled}
    runs: dict[tuple[str, str], list[float]] = {}
    conns = {name: connect(url, autocommit=False) for name, url in urls.items()}
    try:
        conns["direct"].execute(EFFECT_DDL)
        conns["direct"].commit()
        for _ in range(reps):
            for name, conn in conns.items():
                for sql in ("INSERT INTO bench_effect VALUES (%s, 0, 0)", "SELECT %s::bigint"):
                    started = time.perf_counter()
                    for i in range(trips):
                        conn.execute(sql, [i])
                    took = (time.perf_counter() - started) / trips * 1e6
                    runs.setdefault((name, sql[:6]), []).append(took)
                    conn.rollback()
    finally:
        for conn in conns.values():
            conn.close()
    lines = [
        f"| connection | round trip (us), INSERT in a transaction | SELECT (median of {reps}) |",
        "|---|---|---|",
    ]
    for name in urls:
        insert, select = (statistics.median(runs[(name, k)]) for k in ("INSERT", "SELECT"))
        lines.append(f"| {name} | {insert:.0f} | {select:.0f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=2_000)
    parser.add_argument("--only", choices=MODES)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument(
        "--hop", action="store_true", help="only the round trip, direct and through PgBouncer"
    )
    args = parser.parse_args()
    from durable.testing.cluster import TemporaryPgBouncer

    cluster, url = start_cluster()
    bouncer = TemporaryPgBouncer(server_port=cluster.port, pool_size=20)  # type: ignore[attr-defined]
    bouncer.start()
    lines: list[str] = []
    try:
        lines += [*hop(url, bouncer.url(DB)), ""]
        print("\n".join(lines), flush=True)
        for mode in [] if args.hop else [args.only] if args.only else MODES:
            pooled = bouncer.url(DB) if mode == "pgbouncer" else None
            part, _ = profile(url, mode, args.seconds, args.rate, pooled)
            lines += [*part, ""]
            print("\n".join(part), flush=True)
    finally:
        bouncer.destroy()
        cluster.destroy()  # type: ignore[attr-defined]
    lines.append(f"load average at the end: {Path('/proc/loadavg').read_text().strip()}")
    print(lines[-1])
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
