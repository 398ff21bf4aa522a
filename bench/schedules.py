"""Benchmark: cron/interval schedules on one worker; DBOS scheduled workflows side by side.

    python bench/schedules.py                                   # durable only (~4 min)
    python bench/schedules.py --dbos-python /tmp/dbos/bin/python  # plus the DBOS column
    python bench/schedules.py --quick                           # 10 s, 1,000 schedules

Sections:

* **lateness**: 100 schedules ``every(timedelta(seconds=1))`` for 60 s, one worker
  (``Engine.run()``, the loop of ``manage.py run_timer_shards``, in a thread of this
  process so the handler records in memory). Lateness is the wall clock when the handler
  starts minus the occurrence's time; the first 2 s are warm-up. Also counted: SQL
  statements on ``durable_cronschedule`` per occurrence (``execute_wrapper`` on the
  worker's connection). Target: p99 <= 50 ms.
* **memory**: a real ``run_timer_shards`` subprocess; its RSS settled before and after
  10,000 schedules are created: daily cron schedules (their next occurrence is beyond the
  worker's 70-minute horizon) and then 10,000 more every 10 minutes, anchors spread over
  the 10 minutes (all in the horizon, the worst case). Target: <= 20 MB added.
* **no polling**: scans of ``durable_cronschedule`` by anyone (``pg_stat_user_tables``
  ``seq_scan + idx_scan``) during 30 s in which no occurrence is due, with the 10,000
  daily schedules registered. ``pg_stat_statements`` is not needed (it requires
  ``shared_preload_libraries``). Target: 0.

Every section runs on its own fresh database ``durable_bench_cron`` (DBOS: its own
``durable_bench_dbos``; ``DURABLE_BENCH_CRON_DB`` / ``DURABLE_BENCH_DBOS_DB`` name others)
on PostgreSQL at 127.0.0.1. The in-process engine runs with the start-up objects frozen
out of the garbage collector's reach, as ``manage.py run_timer_shards`` runs it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import REPO, Lateness, connect, setup_django

SERVER = "postgres://durable:durable@127.0.0.1:5432"
# Overridable (the database name only), so that sessions sharing the server each drop and
# create databases of their own.
DURABLE_URL = f"{SERVER}/{os.environ.get('DURABLE_BENCH_CRON_DB', 'durable_bench_cron')}"
DBOS_URL = f"{SERVER}/{os.environ.get('DURABLE_BENCH_DBOS_DB', 'durable_bench_dbos')}"
TABLE = "durable_cronschedule"


def fresh_database(url: str) -> None:
    """Drop and create the database of ``url``."""
    name = url.rsplit("/", 1)[1]
    with connect(f"{SERVER}/postgres") as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def table_scans(url: str, table: str) -> int:
    """Sequential plus index scans of ``table`` so far, by every session."""
    with connect(url) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT seq_scan + coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE relname = %s",
            [table],
        ).fetchone()
        return int(row[0]) if row else 0


def reset_tables() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE durable_timer, {TABLE} RESTART IDENTITY")


# -- lateness ---------------------------------------------------------------------------


def lateness(count: int, seconds: float, *, spread: bool) -> dict[str, Any]:
    """``count`` one-second schedules for ``seconds`` on an in-process engine.

    ``spread``: anchors 10 ms apart, so occurrences spread over each second; otherwise
    all of them are due at the same instant (every whole second).
    """
    from django.db import connections
    from django.db.models import Sum

    from bench.peers.cron_side import RECORDER
    from durable.scheduling import schedules
    from durable.worker.engine import Engine

    reset_tables()
    RECORDER.reset()
    for i in range(count):
        schedules.create(
            f"pulse-{i}",
            "bench.peers.cron_side.stamp",
            every=timedelta(seconds=1),
            anchor=_anchor(i * 1_000 // count if spread else 0),
        )
    statements = {"cron": 0}

    def count_cron(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if TABLE in sql:
            statements["cron"] += 1
        return execute(sql, params, many, context)

    engine = Engine(node="bench-cron", threads=4)
    # As manage.py run_timer_shards does before its loop: what is loaded by now lives as
    # long as the process, so full collections skip it. Without this, each full collection
    # rescanned all of Django and the bench (40-110 ms, every 7-10 s here) and, landing in
    # the turn that fires the occurrences, was what made the p99 vary from run to run.
    gc.collect()
    gc.freeze()

    cpu = {"s": 0.0}

    def run() -> None:
        started_cpu = time.thread_time()
        with connections["default"].execute_wrapper(count_cron):
            engine.run(duration_s=seconds + 1)
        cpu["s"] = time.thread_time() - started_cpu

    worker = threading.Thread(target=run, name="engine")
    started = time.time_ns() / 1e6
    worker.start()
    worker.join()
    gc.unfreeze()
    for i in range(count):
        schedules.pause(f"pulse-{i}")
    from durable.models import CronSchedule

    window = (started + 2_000, started + seconds * 1_000)  # the first 2 s are warm-up
    events = [(due, fired) for due, fired in RECORDER.events if window[0] <= due < window[1]]
    samples = [fired - due for due, fired in events]
    fires = CronSchedule.objects.aggregate(ok=Sum("fired_count"), skipped=Sum("skipped_count"))
    return {
        "lateness": Lateness.of(samples),
        "occurrences": len(events),
        "expected": count * int((window[1] - window[0]) // 1_000),
        "skipped": fires["skipped"] or 0,
        "statements_per_run": statements["cron"] / max(1, fires["ok"] or 0),
        "cpu_ms_per_run": cpu["s"] * 1000 / max(1, fires["ok"] or 0),
        "load": os.getloadavg()[0],
    }


# -- memory and polling ---------------------------------------------------------------


def memory_and_polling(count: int, window_s: float) -> dict[str, Any]:
    """RSS a worker adds for ``count`` schedules; scans of the schedule table while idle."""
    from django.db import transaction

    from bench._worker_proc import WorkerProcess
    from durable.scheduling import schedules

    reset_tables()
    out: dict[str, Any] = {}
    with WorkerProcess(DURABLE_URL, "bench-cron-rss") as worker:
        worker.wait_owning(64)
        baseline = worker.settled_rss_mb()
        hour = (time.gmtime().tm_hour + 3) % 24  # daily times well clear of the window
        with transaction.atomic():
            for i in range(count):
                schedules.create(
                    f"daily-{i}", "bench.peers.cron_side.stamp", cron=f"{i % 60} {hour} * * *"
                )
        out["rss_daily_mb"] = worker.settled_rss_mb() - baseline
        before = table_scans(DURABLE_URL, TABLE)
        time.sleep(window_s)
        out["scans_idle"] = table_scans(DURABLE_URL, TABLE) - before
        with transaction.atomic():
            for i in range(count):
                schedules.create(
                    f"ten-{i}",
                    "bench.peers.cron_side.stamp",
                    every=timedelta(minutes=10),
                    anchor=_anchor(i * 600_000 // count),
                )
        time.sleep(5)  # NOTIFY and the rescan put the near-term occurrences in the wheel
        out["rss_in_horizon_mb"] = worker.settled_rss_mb() - baseline
        out["baseline_mb"] = baseline
    return out


def _anchor(offset_ms: int) -> Any:
    from durable.core.timeutil import ms_to_datetime

    return ms_to_datetime(offset_ms)


# -- DBOS -----------------------------------------------------------------------------


def dbos(python: str, count: int, seconds: float, memory_count: int, window_s: float) -> dict:
    """Run the DBOS peer twice (lateness, memory) on a fresh database each time."""
    peer = str(REPO / "bench" / "peers" / "dbos_cron_peer.py")
    results: dict[str, Any] = {}
    for mode, n, s in (("lateness", count, seconds), ("memory", memory_count, window_s)):
        fresh_database(DBOS_URL)
        done = subprocess.run(
            [python, peer, DBOS_URL, mode, str(n), str(s)],
            capture_output=True,
            text=True,
            timeout=seconds + window_s + 600,
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            results[mode] = {"error": (done.stderr or done.stdout)[-800:]}
            continue
        results[mode] = json.loads(lines[-1])
    events = results.get("lateness", {}).get("events")
    if events:
        # The same window as durable's: after 2 s of warm-up, whole seconds only.
        first = min(due for due, _ in events)
        window = (first + 2_000, first + (seconds - 1) * 1_000)
        kept = [(due, fired) for due, fired in events if window[0] <= due < window[1]]
        results["lateness_summary"] = Lateness.of([fired - due for due, fired in kept])
        results["occurrences"] = f"{len(kept)} / {count * int((window[1] - window[0]) // 1_000)}"
    return results


# -- report ---------------------------------------------------------------------------


def _rows(args: argparse.Namespace, ours: dict[str, Any], theirs: dict | None) -> list[tuple]:
    late, mem = ours["lateness"], ours["memory"]
    dl = (theirs or {}).get("lateness_summary")
    dm = (theirs or {}).get("memory", {})
    missing = "not run (pass --dbos-python)" if theirs is None else "failed (see below)"

    def peer(value: Any) -> str:
        return missing if value is None else str(value)

    def fmt(value: float | None) -> str | None:
        return None if value is None else f"{value:.1f}"

    spread, aligned = late["spread"], late["aligned"]
    return [
        (
            "lateness p50 (ms), 100 schedules spread over the second",
            fmt(spread["lateness"].p50),
            "-",
            "",
        ),
        ("lateness p99 (ms), spread", fmt(spread["lateness"].p99), "-", "<= 50"),
        ("lateness max (ms), spread", fmt(spread["lateness"].max), "-", ""),
        (
            "lateness p50 (ms), 100 schedules due at the same instant",
            fmt(aligned["lateness"].p50),
            peer(dl and fmt(dl.p50)),
            "",
        ),
        (
            "lateness p99 (ms), same instant",
            fmt(aligned["lateness"].p99),
            peer(dl and fmt(dl.p99)),
            "<= 50",
        ),
        (
            "lateness max (ms), same instant",
            fmt(aligned["lateness"].max),
            peer(dl and fmt(dl.max)),
            "",
        ),
        (
            "occurrences run in the window / due, spread",
            f"{spread['occurrences']} / {spread['expected']} ({spread['skipped']} skipped)",
            "-",
            "",
        ),
        (
            "occurrences run in the window / due, same instant",
            f"{aligned['occurrences']} / {aligned['expected']} ({aligned['skipped']} skipped)",
            peer(theirs and theirs.get("occurrences")),
            "",
        ),
        (
            "worker CPU per run (ms, engine thread), spread",
            f"{spread['cpu_ms_per_run']:.2f}",
            "-",
            "",
        ),
        (
            "1-minute load average at the end (2 cores)",
            f"{spread['load']:.1f} / {aligned['load']:.1f}",
            "-",
            "",
        ),
        (
            "schedule-table statements per run",
            f"{spread['statements_per_run']:.2f}",
            "-",
            "",
        ),
        (
            f"RSS added, {args.schedules:,} daily schedules (MB)",
            fmt(mem["rss_daily_mb"]),
            peer(fmt(dm.get("rss_added_mb"))),
            "<= 20",
        ),
        (
            f"RSS added, {args.schedules:,} more every 10 min, in the horizon (MB)",
            fmt(mem["rss_in_horizon_mb"]),
            "-",
            "<= 20",
        ),
        (
            f"schedule-table scans in {args.window:.0f} s, nothing due",
            str(mem["scans_idle"]),
            peer(dm.get("scans_in_window")),
            "0",
        ),
    ]


def report(args: argparse.Namespace, ours: dict[str, Any], theirs: dict[str, Any] | None) -> str:
    """The results as a markdown table, with notes on the DBOS run."""
    lines = ["| metric | durable | DBOS | target |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {t} |" for a, b, c, t in _rows(args, ours, theirs)]
    if theirs:
        for mode in ("lateness", "memory"):
            if "error" in theirs.get(mode, {}):
                lines.append(f"\nDBOS {mode} failed: {theirs[mode]['error']}")
        dm = theirs.get("memory", {})
        if "threads_after" in dm:
            lines.append(
                f"\nDBOS threads: {dm['threads_before']} before, {dm['threads_after']} after "
                f"creating {args.schedules:,} schedules (one thread per schedule)."
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="10 s, 1,000 schedules")
    parser.add_argument("--dbos-python", default=None, help="a Python with dbos installed")
    parser.add_argument(
        "--only", default="memory,lateness,dbos", help="sections: memory, lateness, dbos"
    )
    args = parser.parse_args()
    args.seconds = 10.0 if args.quick else 60.0
    args.schedules = 1_000 if args.quick else 10_000
    args.window = 10.0 if args.quick else 30.0
    fresh_database(DURABLE_URL)
    setup_django(DURABLE_URL, DJANGO_DEBUG="false", DURABLE_LOG_LEVEL="WARNING")
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    print(f"# {platform.platform()}, Python {platform.python_version()}", flush=True)
    only = set(args.only.split(","))
    ours: dict[str, Any] = {}
    if "memory" in only:
        ours["memory"] = memory_and_polling(args.schedules, args.window)
        print(f"memory: {ours['memory']}", flush=True)
    if "lateness" in only:
        ours["lateness"] = {
            "spread": lateness(100, args.seconds, spread=True),
            "aligned": lateness(100, args.seconds, spread=False),
        }
        for variant, result in ours["lateness"].items():
            print(f"lateness, {variant}: {result}", flush=True)
    theirs = None
    if args.dbos_python and "dbos" in only:
        theirs = dbos(args.dbos_python, 100, args.seconds, args.schedules, args.window)
        print(f"dbos: { {k: v for k, v in theirs.items() if k != 'lateness'} }", flush=True)
    if {"memory", "lateness"} <= only:
        print(report(args, ours, theirs))


if __name__ == "__main__":
    main()
