"""Benchmark: Celery tasks due later, through ``durable.schedule_celery`` vs ``countdown``.

    python bench/celery.py                          # 20,000 tasks due within 10 s
    python bench/celery.py --count 2000 --lead 10   # a quick look
    python bench/celery.py --markdown /tmp/celery_results.md   # merged into docs/benchmarks.md

One Redis broker and one stock Celery worker (``testproject.celery_app``, prefork, 4
processes) serve both phases, durable's first:

* **durable**: a real ``manage.py run_timer_shards`` worker (PostgreSQL) holds the
  timers; ``schedule_celery`` writes them ``--lead`` seconds ahead; the worker publishes
  each when due.
* **countdown**: ``record.apply_async(countdown=...)`` publishes at once; the Celery
  worker keeps every message in memory until its ETA.

Measured: publish lateness (durable only: the timer's completion, stamped just after the
broker took the message, minus its due time), execution lateness (the task's start in the
Celery worker minus its due time), and the Celery worker's resident memory (the whole
process tree) while the tasks wait and while they run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

# This file is named celery.py: keep its own folder off sys.path, so that "import celery"
# finds Celery and not this script; the repository root goes on instead (for bench.*).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from bench._common import REPO, percentile, setup_django, wait_until, wall_ms  # noqa: E402

DATABASE_URL = "postgres://durable:durable@127.0.0.1:5432/durable_bench_celery"
BROKER_URL = "redis://127.0.0.1:6379/14"


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants, in MiB (from /proc)."""
    total_kb, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total_kb += int(
                next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]
            )
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total_kb / 1024


class RssSampler:
    """Samples a process tree's RSS every 200 ms in a thread, tagged with the phase."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((wall_ms(), tree_rss_mb(self.pid)))
            self._stop.wait(0.2)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, start_ms: float, end_ms: float) -> float:
        """Largest sample between two instants."""
        values = [mb for when, mb in self.samples if start_ms <= when <= end_ms]
        return max(values) if values else float("nan")


def ensure_database() -> None:
    """Create and migrate the bench database (idempotent)."""
    import psycopg

    name = DATABASE_URL.rsplit("/", 1)[1]
    admin = DATABASE_URL.rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start a subprocess from the repository root, logging to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def executions(out_dir: Path, prefix: str) -> list[dict]:
    """What the Celery worker ran for keys starting with ``prefix``."""
    from testproject.celery_app import read_executions

    return [r for r in read_executions(out_dir) if r["key"].startswith(prefix)]


def due_times(count: int, lead_s: float, window_s: float) -> list[int]:
    """``count`` due times spread evenly over ``window_s``, starting ``lead_s`` from now."""
    first = int(wall_ms() + lead_s * 1000)
    return [first + int(i * window_s * 1000 / count) for i in range(count)]


def run_durable(args: argparse.Namespace, out_dir: Path, rss: RssSampler, env: dict) -> dict:
    """Phase 1: schedule_celery, published by a real worker when due."""
    from django.db import transaction

    import durable
    from durable.models import ShardLease, Timer

    Timer.objects.all().delete()
    ShardLease.objects.all().delete()  # --shards may differ from the last run's
    worker = start(
        [sys.executable, "manage.py", "run_timer_shards", "--node", "bench", "--threads", "8"],
        env,
        out_dir / "durable-worker.log",
    )
    try:
        wait_until(lambda: ShardLease.objects.filter(owner="bench").count() == args.shards, 60)
        phase_start = wall_ms()
        dues = due_times(args.count, args.lead, args.window)
        with transaction.atomic():
            for i, due in enumerate(dues):
                durable.schedule_celery(
                    "testproject.record",
                    args=[f"d{i}"],
                    kwargs={"due_ms": due},
                    at=datetime.fromtimestamp(due // 1000, tz=UTC).replace(
                        microsecond=due % 1000 * 1000
                    ),
                )
        scheduled_s = (wall_ms() - phase_start) / 1000
        done = wait_until(lambda: len(executions(out_dir, "d")) >= args.count, 300, 0.2)
        end = wall_ms()
        fired = Timer.objects.filter(state="fired").values_list("fire_at_ms", "fired_at")
        publish = [f.timestamp() * 1000 - due for due, f in fired]
    finally:
        stop(worker)
    return summarize("durable", out_dir, "d", args, dues, rss, phase_start, end, done) | {
        "publish": publish,
        "scheduled_s": scheduled_s,
    }


def run_countdown(args: argparse.Namespace, out_dir: Path, rss: RssSampler) -> dict:
    """Phase 2: apply_async(countdown=...) straight to the broker."""
    from testproject.celery_app import record

    phase_start = wall_ms()
    dues = due_times(args.count, args.lead, args.window)
    for i, due in enumerate(dues):
        countdown = max(0.0, (due - wall_ms()) / 1000)
        record.apply_async(args=[f"c{i}"], kwargs={"due_ms": due}, countdown=countdown)
    scheduled_s = (wall_ms() - phase_start) / 1000
    done = wait_until(lambda: len(executions(out_dir, "c")) >= args.count, 300, 0.2)
    end = wall_ms()
    return summarize("countdown", out_dir, "c", args, dues, rss, phase_start, end, done) | {
        "publish": [],
        "scheduled_s": scheduled_s,
    }


def summarize(name, out_dir, prefix, args, dues, rss, start_ms, end_ms, done) -> dict:
    """Lateness and memory figures of one phase."""
    runs = executions(out_dir, prefix)
    keys = [r["key"] for r in runs]
    return {
        "name": name,
        "done": done,
        "ran": len(set(keys)),
        "duplicates": len(keys) - len(set(keys)),
        "early": sum(1 for r in runs if r["ran_ms"] < r["due_ms"]),
        "earliest": min((r["ran_ms"] - r["due_ms"] for r in runs), default=0),
        "exec": [r["ran_ms"] - r["due_ms"] for r in runs],
        "rss_before": rss.peak(start_ms - 1500, start_ms),
        "rss_waiting": rss.peak(start_ms, dues[0]),
        "rss_running": rss.peak(dues[0], end_ms),
    }


def fmt(values: list[float], q: float) -> str:
    """A percentile in ms, or n/a."""
    return "n/a" if not values else f"{percentile(values, q):.0f}"


def table(results: list[dict], args: argparse.Namespace) -> str:
    """The results as a markdown table."""
    lines = [
        f"{args.count:,} tasks due within {args.window:g} s, scheduled {args.lead:g} s ahead; "
        f"Redis broker, Celery worker prefork x4, one durable worker, {args.shards} shards "
        f"(Python {platform.python_version()}, {os.cpu_count()} CPUs).",
        "",
        "| | durable.schedule_celery | apply_async(countdown) |",
        "|---|---|---|",
    ]
    d, c = results
    rows = [
        ("scheduling all of them (s)", f"{d['scheduled_s']:.1f}", f"{c['scheduled_s']:.1f}"),
        ("tasks run / duplicates / early", _counts(d), _counts(c)),
        ("publish lateness p50 / p99 / max (ms)", _pct(d["publish"]), "published at once"),
        ("execution lateness p50 / p99 / max (ms)", _pct(d["exec"]), _pct(c["exec"])),
        ("Celery worker RSS before (MiB)", f"{d['rss_before']:.0f}", f"{c['rss_before']:.0f}"),
        (
            "Celery worker RSS while waiting, peak",
            f"{d['rss_waiting']:.0f}",
            f"{c['rss_waiting']:.0f}",
        ),
        (
            "Celery worker RSS while running, peak",
            f"{d['rss_running']:.0f}",
            f"{c['rss_running']:.0f}",
        ),
    ]
    lines += [f"| {a} | {b} | {cc} |" for a, b, cc in rows]
    return "\n".join(lines)


def _counts(r: dict) -> str:
    early = f" (by {-r['earliest']} ms at most)" if r["early"] else ""
    return f"{r['ran']:,} / {r['duplicates']} / {r['early']}{early}"


def _pct(values: list[float]) -> str:
    return f"{fmt(values, 50)} / {fmt(values, 99)} / {fmt(values, 100)}"


def main() -> None:
    """Run both phases and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--window", type=float, default=10.0, help="seconds the dues span")
    parser.add_argument("--lead", type=float, default=30.0, help="seconds before the first due")
    parser.add_argument("--shards", type=int, default=64, help="DURABLE['SHARDS']")
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    ensure_database()
    out_dir = Path(tempfile.mkdtemp(prefix="durable-celery-bench-"))
    env = {
        **os.environ,
        "DATABASE_URL": DATABASE_URL,
        "DURABLE_BROKER_URL": BROKER_URL,
        "CELERY_BROKER_URL": BROKER_URL,
        "CELERY_OUT_DIR": str(out_dir),
        "DURABLE_LOG_LEVEL": "WARNING",
        "DJANGO_DEBUG": "false",
        "DURABLE_SHARDS": str(args.shards),
    }
    shared = ("CELERY_BROKER_URL", "CELERY_OUT_DIR", "DJANGO_DEBUG", "DURABLE_SHARDS")
    os.environ.update({k: env[k] for k in shared})
    setup_django(DATABASE_URL, DURABLE_BROKER_URL=BROKER_URL)
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from kombu import Connection

    with Connection(BROKER_URL) as conn:
        conn.SimpleQueue("celery").clear()
    celery = start(
        [
            *(sys.executable, "-m", "celery", "-A", "testproject.celery_app", "worker"),
            *("-c", "4", "-l", "WARNING"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        ],
        env,
        out_dir / "celery-worker.log",
    )
    try:
        time.sleep(5)  # the worker's processes up and consuming
        with RssSampler(celery.pid) as rss:
            results = [run_durable(args, out_dir, rss, env), run_countdown(args, out_dir, rss)]
    finally:
        stop(celery)
    text = table(results, args)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
