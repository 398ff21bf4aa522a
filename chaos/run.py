"""The chaos run's orchestrator: ``python -m chaos`` (``make chaos``).

1. (Re)creates the run's own PostgreSQL database (``--database-url``, by default
   ``durable_chaos`` on the local server; never the tests' database) and migrates it; or,
   with ``--pg-restart``, a throwaway cluster it owns (initdb in a temporary directory,
   root needed), the only kind of server the nemesis may restart.
2. Starts ``--workers`` ``run_timer_shards`` processes with durable's DEFAULT settings
   (only the database and the chaos handlers' module are set) and waits until they own
   every shard.
3. Runs the load generator (:mod:`chaos.load`) for ``--minutes`` while the nemesis
   (:mod:`chaos.nemesis`) strikes at seeded random times.
4. Heals everything, drains (waits until the load's work is all done, up to ``--drain-s``),
   stops the workers, and gives the history and the tables to the checker.
5. Prints the table; on any violation, the seed, the fault schedule and the ids, and
   exits 1. Everything (history, faults, worker logs, verdict) stays in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from chaos import celery_dispatch
from chaos.nemesis import KINDS

REPO = Path(__file__).resolve().parents[1]
TIMER_FIELDS = ("id", "state", "target", "args", "attempts", "max_attempts", "fire_at_ms")
TIMER_FIELDS += ("key", "updated_at", "last_error")
DEFAULT_URL = "postgres://durable:durable@127.0.0.1:5432/durable_chaos"


def default_seed() -> int:
    """Today's date as a number (20261201): CI rotates seeds by the day."""
    return int(dt.datetime.now(dt.UTC).strftime("%Y%m%d"))


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def recreate_database(url: str) -> None:
    """Drop and create the database ``url`` names (connecting to ``postgres`` to do it)."""
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    if not name or name in ("postgres", "template0", "template1"):
        raise SystemExit(f"--database-url: refusing to recreate database {name!r}")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=None, help="default: today (YYYYMMDD)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rate", type=float, default=25.0, help="load transactions per second")
    parser.add_argument("--load-threads", type=int, default=1, help="load generators at once")
    parser.add_argument("--together", type=int, default=1, help="plain timers per load transaction")
    parser.add_argument("--fault-every-s", type=float, default=5.0, help="mean time between")
    parser.add_argument("--drain-s", type=float, default=120.0)
    parser.add_argument("--database-url", default=os.environ.get("CHAOS_DATABASE_URL", DEFAULT_URL))
    parser.add_argument(
        "--pg-restart",
        action="store_true",
        help="run on a throwaway cluster (initdb, root) and add PostgreSQL restarts",
    )
    parser.add_argument(
        "--raft",
        action="store_true",
        help="the workers run Raft (DURABLE['RAFT']) behind the run's proxy; adds partitions "
        "and link delays to the faults",
    )
    parser.add_argument(
        "--lateness",
        choices=["fail", "report"],
        default="fail",
        help="whether lateness past the documented bounds fails the run or is only reported",
    )
    parser.add_argument(
        "--faults",
        default=",".join(KINDS),
        help=f"comma-separated fault kinds the nemesis uses (default: {','.join(KINDS)})",
    )
    celery_dispatch.add_arguments(parser)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--recheck",
        type=Path,
        default=None,
        metavar="DIR",
        help="check a finished run again (its files in DIR, its database still there)",
    )
    args = parser.parse_args(argv)
    args.faults = tuple(k for k in args.faults.split(",") if k)
    unknown = sorted(set(args.faults) - set(KINDS))
    if unknown:
        parser.error(f"--faults: unknown kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
    if args.workers < 2:
        parser.error("--workers: at least 2 (the nemesis keeps one up while it kills another)")
    if args.seed is None:
        args.seed = default_seed()
    return args


def main(argv: list[str] | None = None) -> None:
    """Entry point: run, check, report; exit 1 on any violation."""
    args = parse(argv)
    if args.recheck is not None:
        sys.exit(0 if recheck(args) else 1)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
    out: Path = args.out or REPO / ".chaos" / f"{stamp}-seed{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    celery = celery_dispatch.Session.open(args, out, stamp)  # first: a dead broker stops it
    cluster = None
    restart_db = None
    url = args.database_url
    try:
        if args.pg_restart:
            from durable.testing.cluster import TemporaryCluster

            cluster = TemporaryCluster()
            cluster.start()
            url = cluster.create_database("durable_chaos")
            restart_db = cluster.restart
        else:
            recreate_database(url)
        ok = run(args, url, out, restart_db, celery)
    finally:
        if celery is not None:
            celery.stop()
            celery.close()
        if cluster is not None:
            cluster.destroy()
    sys.exit(0 if ok else 1)


def run(args: argparse.Namespace, url: str, out: Path, restart_db: Any, celery: Any) -> bool:
    os.environ["DATABASE_URL"] = url
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    for key in [k for k in os.environ if k.startswith("DURABLE_")]:
        del os.environ[key]  # the workers and this process run durable's defaults
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0, interactive=False)
    from chaos.nemesis import Nemesis
    from tests.acceptance.helpers import WorkerPool

    print(f"chaos: seed {args.seed}, {args.minutes} min, {args.workers} workers, out {out}")
    names = [f"w{i + 1}" for i in range(args.workers)]
    raft = None
    if args.raft:
        from chaos import raft as raft_setup
        from durable.conf import get_settings

        raft = raft_setup.start(names, get_settings().SHARDS)
    pool = WorkerPool(
        database_url=url,
        log_dir=out,
        defaults=True,
        env={
            "DURABLE_IMPORTS": "testproject.demo.chaos",
            "DURABLE_LOG_LEVEL": "INFO",
            **(raft.env() if raft else {}),
            **(celery.worker_env() if celery else {}),
        },
    )
    faults_path = out / "faults.jsonl"
    history_path = out / "history.jsonl"
    t0_ms = wall_ms()
    try:
        for name in names:
            pool.start(name, *(raft.args(name) if raft else []))
        wait_for_shards(pool, names)
        with faults_path.open("w") as faults_log:
            nemesis = Nemesis(
                pool=pool,
                names=names,
                seed=args.seed,
                dsn=url,
                log=faults_log,
                kinds=args.faults,
                mean_interval_s=args.fault_every_s,
                restart_db=restart_db,
                raft=raft,
            )
            load = start_load(args, history_path, out, celery.load_args() if celery else [])
            while load.poll() is None:
                nemesis.tick()
                nemesis.watch_crashes()
                time.sleep(0.1)
            nemesis.heal_all()
            if load.returncode != 0:
                print(f"chaos: the load generator exited {load.returncode}; see {out}/load.log")
            drained = drain(pool, nemesis, args.drain_s)
            if celery is not None:
                celery.finish()  # every message the workers published, in the ledger
            end_ms = wall_ms()
            summary = celery.summary() if celery else None
            (out / "run.json").write_text(
                json.dumps({"t0_ms": t0_ms, "end_ms": end_ms, "celery": summary})
            )
            print(
                f"chaos: drained in {drained:.1f} s" if drained >= 0 else "chaos: drain timed out"
            )
    finally:
        pool.stop_all()
        if raft is not None:
            raft.close()
    return check_and_report(args, out, t0_ms, end_ms, summary)


def recheck(args: argparse.Namespace) -> bool:
    """Check the run in ``args.recheck`` again (after a change to the checker)."""
    os.environ["DATABASE_URL"] = args.database_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    import django

    django.setup()
    times = json.loads((args.recheck / "run.json").read_text())
    return check_and_report(
        args, args.recheck, times["t0_ms"], times["end_ms"], times.get("celery")
    )


def start_load(
    args: argparse.Namespace, history: Path, out: Path, extra: list[str]
) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "chaos.load",
        "--history",
        str(history),
        "--seed",
        str(args.seed),
        "--seconds",
        str(args.minutes * 60),
        "--rate",
        str(args.rate),
        "--threads",
        str(args.load_threads),
        "--together",
        str(args.together),
        *extra,
    ]
    log = (out / "load.log").open("ab")
    return subprocess.Popen(command, cwd=REPO, env=dict(os.environ), stdout=log, stderr=log)


def wait_for_shards(pool: Any, names: list[str], timeout_s: float = 90.0) -> None:
    from durable.conf import get_settings
    from durable.models import ShardLease

    shards = get_settings().SHARDS
    pool.wait_until(
        lambda: ShardLease.objects.filter(owner__in=names).count() == shards,
        timeout_s=timeout_s,
        what="the workers owning every shard",
    )


def settled() -> bool:
    """True when the load's work is all done: no timer pending or firing but the
    schedules' next occurrences, and no workflow run unfinished.

    Every timer the load commits is due within seconds (and a retry's backoff adds
    seconds more), and the checker holds each one to having fired: a timer that is
    merely not due yet is not settled. (Waiting only for timers already due let the
    workers stop before a timer committed in the load's last seconds came due, and the
    checker then reported it lost: seed 20261203.) Cron occurrence timers are always
    pending, one per schedule, and the checker judges occurrences by their runs.
    """
    from django.db import DatabaseError, connection

    from durable.models import Timer, TimerKind, WorkflowRun

    try:
        waiting = Timer.objects.filter(state="pending").exclude(kind=TimerKind.CRON).exists()
        busy = Timer.objects.filter(state="firing").exists()
        runs = WorkflowRun.objects.filter(state__in=["pending", "running", "sleeping"])
        return not (waiting or busy or runs.exists())
    except DatabaseError:  # our session did not survive a PostgreSQL restart
        connection.close()
        return False


def drain(pool: Any, nemesis: Any, timeout_s: float) -> float:
    """Wait until the load's work is all done (:func:`settled`); return the seconds it
    took, or -1 on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        nemesis.watch_crashes()
        nemesis.heal_all()
        if settled():
            return time.monotonic() - start
        time.sleep(0.5)
    return -1.0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_and_report(
    args: argparse.Namespace, out: Path, t0_ms: int, end_ms: int, celery: Any = None
) -> bool:
    from django.db import connection

    from chaos import checker, logs, report
    from durable.conf import get_settings
    from durable.models import CronSchedule, Timer, WorkflowRun
    from testproject.demo.models import FireRecord

    connection.close()  # a fresh session: the last one may predate a PostgreSQL restart
    conf = get_settings()
    bounds = checker.Bounds(
        lease_ttl_s=conf.LEASE_TTL_S,
        rescan_s=conf.RESCAN_INTERVAL_S,
        batch_budget_s=conf.BATCH_TIME_BUDGET_S,
        atomic_timeout_s=conf.ATOMIC_TIMEOUT_S,
    )
    faults = read_jsonl(out / "faults.jsonl")
    history = checker.History(
        ops=read_jsonl(out / "history.jsonl"),
        faults=faults,
        ledger=list(FireRecord.objects.values_list("key", "fired_at_ms", "due_at_ms")),
        timers=[
            {**row, "updated_ms": int(row.pop("updated_at").timestamp() * 1000)}
            for row in Timer.objects.values(*TIMER_FIELDS)
        ],
        runs=list(WorkflowRun.objects.values("id", "name", "state", "result")),
        schedules=list(CronSchedule.objects.values("name", "next_ms", "skipped_count")),
        holds=logs.loop_holds(out),
        retries=logs.retries(out),
        deliveries=celery_dispatch.read_deliveries(out),
        published=logs.published(out),
        celery=celery,
        end_ms=end_ms,
        bounds=bounds,
    )
    lenient = frozenset({"lateness_within_bound"}) if args.lateness == "report" else frozenset()
    verdict = checker.check(history, report_only=lenient)
    (out / "verdict.json").write_text(
        json.dumps(
            {
                "seed": args.seed,
                "minutes": args.minutes,
                "workers": args.workers,
                "ok": verdict.ok,
                "faults": verdict.faults,
                "ops": verdict.ops,
                "checked": verdict.checked,
                "lateness_ms": verdict.lateness,
                "chained": verdict.chained,
                "celery": verdict.celery,
                "worst": verdict.worst,
                "violations": verdict.violations,
            },
            indent=1,
        )
    )
    print(report.table(verdict))
    if any(verdict.violations.values()):
        replay = f"make chaos SEED={args.seed} MINUTES={args.minutes:g} WORKERS={args.workers}"
        replay += " RAFT=1" if getattr(args, "raft", False) else ""
        print(
            report.failure_details(
                verdict, seed=args.seed, faults=faults, t0_ms=t0_ms, replay=replay
            )
        )
    print(f"\nchaos: {'OK' if verdict.ok else 'FAILED'} (seed {args.seed}); files in {out}")
    return verdict.ok
