"""Benchmark: durable workflows (and DBOS Transact, if given) on one PostgreSQL.

    python bench/workflows.py                          # full run
    python bench/workflows.py --quick                  # small sizes
    python bench/workflows.py --dbos /tmp/dbosenv/bin/python   # DBOS side by side

Every commit is synchronous by default (``ASYNC_COMMIT`` off); the end-to-end and drain
sections run twice, with the default and with the ``ASYNC_COMMIT`` opt-in, in one run.

Sections: a 10-step workflow (``testproject.demo.workflows.ten_steps``) run one at a
time end to end (start, worker picks it up, completed), then drained by a worker with one
executor thread (sequential execution) and with eight (concurrent); the overhead of one
step (replaying 10-step against 0-step workflows in-process); starting runs one by one
and in bulk (``start_many``); 10,000 sleeping workflows (wake lateness, and the worker's
threads and RSS while they sleep).

The worker is a real ``manage.py run_timer_shards`` subprocess with default settings,
``DEBUG=False``, persistent database connections (``conn_max_age=600`` in the URL) and
psycopg's prepared statements (``prepare_threshold=5``, set by the test project's
settings), as docs/how-to/run-the-worker.md says a worker should run. The one-at-a-time
caller waits with ``get_result(run, timeout=...)``. DBOS runs in its own virtualenv and process
(``bench/peers/dbos_peer.py``) on its own database of the same server.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ADMIN = "postgres://durable:durable@127.0.0.1:5432/postgres"
URL = "postgres://durable:durable@127.0.0.1:5432/durable_wf_bench"
DBOS_URL = "postgres://durable:durable@127.0.0.1:5432/durable_wf_bench_dbos"
WORKER_URL = URL + "?conn_max_age=600"


def create_databases() -> None:
    import psycopg

    with psycopg.connect(ADMIN, autocommit=True) as conn:
        for url in (URL, DBOS_URL):
            name = url.rsplit("/", 1)[1]
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")


def setup_django() -> None:
    os.environ.update(
        DATABASE_URL=URL,
        DJANGO_SETTINGS_MODULE="testproject.settings",
        DURABLE_LOG_LEVEL="WARNING",
        DJANGO_DEBUG="false",
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


class Worker:
    """A ``run_timer_shards`` subprocess; reads its threads and RSS from /proc."""

    def __init__(self, threads: int, async_commit: bool = False) -> None:
        self.log = open(f"/tmp/bench-workflows-{threads}.log", "w")  # noqa: SIM115
        env = {
            **os.environ,
            "DATABASE_URL": WORKER_URL,
            "DURABLE_LOG_LEVEL": "WARNING",
            # Synchronous checkpoints are the default; the opt-in is measured beside them.
            "DURABLE_ASYNC_COMMIT": "true" if async_commit else "false",
        }
        command = [sys.executable, "manage.py", "run_timer_shards", "--threads", str(threads)]
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        from durable.models import ShardLease

        deadline = time.monotonic() + 60
        while ShardLease.objects.exclude(owner="").count() < 64:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"worker did not take the shards; see {self.log.name}")
            time.sleep(0.05)
        self.warm_up(threads)

    def warm_up(self, threads: int) -> None:
        """Run a few workflows through every executor thread before measuring (each opens
        its database connection on first use), as the DBOS peer runs one first."""
        from durable.models import Timer, WorkflowRun
        from testproject.demo.workflows import ten_steps

        runs = ten_steps.start_many({"args": [i]} for i in range(2 * threads))
        ids = [run.pk for run in runs]
        deadline = time.monotonic() + 60
        while WorkflowRun.objects.filter(pk__in=ids, state="completed").count() < len(ids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"warm-up runs did not complete; see {self.log.name}")
            time.sleep(0.01)
        WorkflowRun.objects.filter(pk__in=ids).delete()
        Timer.objects.filter(target__in=ids).delete()

    def status(self, key: str) -> float:
        """A field of /proc/<pid>/status (``VmRSS`` in MB, ``Threads``)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                value = int(line.split()[1])
                return value / 1024 if key == "VmRSS" else value
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def reset() -> None:
    from durable.models import Timer, WorkflowRun

    WorkflowRun.objects.all().delete()
    Timer.objects.all().delete()


def wait_done(count: int, timeout_s: float = 600) -> float:
    """Wait until ``count`` runs completed; return when (monotonic)."""
    from durable.models import WorkflowRun

    deadline = time.monotonic() + timeout_s
    while WorkflowRun.objects.filter(state="completed").count() < count:
        if time.monotonic() > deadline:
            raise RuntimeError("runs did not complete in time")
        time.sleep(0.02)
    return time.monotonic()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def one_at_a_time(n: int, async_commit: bool = False) -> dict[str, float]:
    """Start, wait for the result, next: end-to-end latency through a worker."""
    from durable.workflows import get_result
    from testproject.demo.workflows import ten_steps

    worker = Worker(threads=8, async_commit=async_commit)
    latencies = []
    started = time.monotonic()
    for i in range(n):
        begun = time.monotonic()
        run = ten_steps.start(i)
        get_result(run.pk, timeout=60)  # polls the run's row, every 1 ms at first
        latencies.append((time.monotonic() - begun) * 1000)
    took = time.monotonic() - started
    worker.stop()
    mode = "_async" if async_commit else ""
    return {
        f"e2e_wf_s{mode}": n / took,
        f"e2e_p50_ms{mode}": pct(latencies, 50),
        f"e2e_p99_ms{mode}": pct(latencies, 99),
    }


def drain(n: int, threads: int, async_commit: bool = False) -> dict[str, float]:
    """Queue ``n`` runs, then let a worker with ``threads`` executor threads drain them."""
    from testproject.demo.workflows import ten_steps

    reset()
    worker = Worker(threads=threads, async_commit=async_commit)
    started = time.monotonic()
    ten_steps.start_many({"args": [i]} for i in range(n))
    took = wait_done(n) - started
    worker.stop()
    return {f"drain{threads}_wf_s{'_async' if async_commit else ''}": n / took}


def step_overhead(n: int) -> dict[str, float]:
    """Replay 10-step and 0-step workflows in-process, one after the other."""
    from durable.workflows.resume import resume_once
    from testproject.demo.workflows import no_steps, ten_steps

    reset()
    timings = {}
    for workflow in (no_steps, ten_steps):
        runs = workflow.start_many({"args": [i]} for i in range(n))
        started = time.perf_counter()
        for run in runs:
            resume_once(run.pk)
        timings[workflow.__name__] = (time.perf_counter() - started) / n * 1000
    return {
        "step_ms": (timings["ten_steps"] - timings["no_steps"]) / 10,
        "replay0_ms": timings["no_steps"],
    }


def starts(n: int) -> dict[str, float]:
    """``start()`` one by one (autocommit, a transaction each) and ``start_many`` in one."""
    from django.db import transaction

    from testproject.demo.workflows import ten_steps

    reset()
    started = time.perf_counter()
    for i in range(n // 10):
        ten_steps.start(i)
    single = (n // 10) / (time.perf_counter() - started)
    started = time.perf_counter()
    with transaction.atomic():
        ten_steps.start_many({"args": [i]} for i in range(n))
    bulk = n / (time.perf_counter() - started)
    reset()
    return {"start_per_s": single, "start_many_per_s": bulk}


_ASLEEP_SQL = [
    # What each run's first replay writes, in bulk: its sleep record, its state, and its
    # start timer turned into the sleep's wake-up timer.
    "INSERT INTO durable_workflowstep (run_id, seq, kind, name, status, result, error, "
    "attempts, wake_ms, created_at, updated_at) SELECT id, 0, 'sleep', 'sleep', 'waiting', "
    "args->0, '', 0, (args->>0)::bigint, now(), now() FROM durable_workflowrun",
    "UPDATE durable_workflowrun SET state = 'sleeping'",
    "UPDATE durable_timer t SET key = 'wf:' || r.id || ':0', fire_at_ms = (r.args->>0)::bigint, "
    "bucket = (r.args->>0)::bigint >> 16 FROM durable_workflowrun r WHERE t.target = r.id",
]


def sleepers(n: int) -> dict[str, float]:
    """``n`` runs asleep, waking over a 4 s window: lateness, and threads and RSS."""
    from django.db import connection, transaction

    from durable.models import WorkflowStep
    from testproject.demo.workflows import nap_until

    reset()
    worker = Worker(threads=8)
    time.sleep(3)
    base_rss, base_threads = worker.status("VmRSS"), worker.status("Threads")
    window = int(time.time() * 1000) + 20_000
    with transaction.atomic():  # the worker only ever sees them asleep
        nap_until.start_many({"args": [window + random.randint(1000, 5000)]} for _ in range(n))
        with connection.cursor() as cursor:
            for sql in _ASLEEP_SQL:
                cursor.execute(sql)
    # The bulk rewrite above left a dead version of every run and timer, which
    # autovacuum would otherwise clean up in the middle of the wake window: an artifact of
    # this setup, not of sleepers that went to sleep one by one.
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE durable_workflowrun, durable_workflowstep, durable_timer")
    time.sleep(max(0.0, (window - 8_000) / 1000 - time.time()))
    asleep_rss, asleep_threads = worker.status("VmRSS"), worker.status("Threads")
    peak_rss, peak_threads = asleep_rss, asleep_threads
    while WorkflowStep.objects.filter(kind="sleep", status="done").count() < n:
        peak_rss = max(peak_rss, worker.status("VmRSS"))
        peak_threads = max(peak_threads, worker.status("Threads"))
        time.sleep(0.2)
    wait_done(n, timeout_s=120)
    worker.stop()
    rows = WorkflowStep.objects.filter(kind="sleep").values_list("wake_ms", "run__finished_at")
    late = [finished.timestamp() * 1000 - wake for wake, finished in rows]
    return {
        "sleep_p50_ms": pct(late, 50),
        "sleep_p99_ms": pct(late, 99),
        "sleep_threads_added": asleep_threads - base_threads,
        "sleep_rss_added_mb": asleep_rss - base_rss,
        "wake_threads_added": peak_threads - base_threads,
        "wake_rss_added_mb": peak_rss - base_rss,
    }


def run_dbos(python: str, quick: bool) -> dict[str, float]:
    sizes = ["50", "200", "100", "200"] if quick else ["300", "1000", "500", "1000"]
    command = [python, str(REPO / "bench/peers/dbos_peer.py"), DBOS_URL, *sizes]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dbos", help="a Python with dbos installed: run DBOS side by side")
    args = parser.parse_args()
    create_databases()
    setup_django()
    q = args.quick
    results: dict[str, float] = {}
    for async_commit in (False, True):  # the default, then the opt-in
        reset()
        results |= one_at_a_time(50 if q else 300, async_commit)
        results |= drain(100 if q else 500, threads=1, async_commit=async_commit)
        results |= drain(300 if q else 2000, threads=8, async_commit=async_commit)
    results |= step_overhead(50 if q else 300)
    results |= starts(2000 if q else 10_000)
    results |= sleepers(1000 if q else 10_000)
    peer = run_dbos(args.dbos, q) if args.dbos else {}
    report(results, peer)


def _rows(ours: dict[str, float], peer: dict[str, float]) -> list[tuple[str, ...]]:
    def get(key: str, scale: float = 1.0) -> str:
        return f"{peer[key] * scale:.0f}" if key in peer else "-"

    def ratio(mine: float, key: str) -> str:
        return f"{mine / peer[key]:.1f}x" if peer.get(key) else ""

    late = f"{ours['sleep_p50_ms']:.1f} / {ours['sleep_p99_ms']:.1f}"
    peer_late = f"{get('sleep_p50_ms')} / {get('sleep_p99_ms')}"
    e2e = f"{ours['e2e_p50_ms']:.1f} / {ours['e2e_p99_ms']:.1f}"
    e2e_async = f"{ours['e2e_p50_ms_async']:.1f} / {ours['e2e_p99_ms_async']:.1f}"
    opt_in = [
        ("ASYNC_COMMIT=True (opt-in): one at a time, steps/s", f"{ours['e2e_wf_s_async'] * 10:.0f}",
         get("seq_wf_s", 10), ratio(ours["e2e_wf_s_async"], "seq_wf_s"), ""),
        ("  start -> completed p50 / p99 (ms)", e2e_async, "-", "", ""),
        ("  steps/s, 1 executor thread", f"{ours['drain1_wf_s_async'] * 10:.0f}",
         get("seq_wf_s", 10), ratio(ours["drain1_wf_s_async"], "seq_wf_s"), ""),
        ("  steps/s, 8 threads", f"{ours['drain8_wf_s_async'] * 10:.0f}", get("conc_wf_s", 10),
         ratio(ours["drain8_wf_s_async"], "conc_wf_s"), ""),
    ]  # fmt: skip
    default = [
        ("10-step workflows one at a time, start -> result (wf/s)", f"{ours['e2e_wf_s']:.0f}",
         get("seq_wf_s"), ratio(ours["e2e_wf_s"], "seq_wf_s"), ""),
        ("  steps/s", f"{ours['e2e_wf_s'] * 10:.0f}", get("seq_wf_s", 10),
         ratio(ours["e2e_wf_s"], "seq_wf_s"), "3x DBOS sequential"),
        ("  start -> completed p50 / p99 (ms)", e2e, "-", "", ""),
        ("steps/s, worker with 1 executor thread (one run at a time)",
         f"{ours['drain1_wf_s'] * 10:.0f}", get("seq_wf_s", 10),
         ratio(ours["drain1_wf_s"], "seq_wf_s"), "3x DBOS sequential"),
        ("steps/s, worker with 8 threads", f"{ours['drain8_wf_s'] * 10:.0f}",
         get("conc_wf_s", 10), ratio(ours["drain8_wf_s"], "conc_wf_s"), "3x DBOS concurrent"),
        ("workflows/s, 8 threads", f"{ours['drain8_wf_s']:.0f}", get("conc_wf_s"),
         ratio(ours["drain8_wf_s"], "conc_wf_s"), ""),
        ("overhead of one step (ms, in-process replay)", f"{ours['step_ms']:.2f}", "-", "", ""),
        ("replay of a 0-step workflow (ms)", f"{ours['replay0_ms']:.2f}", "-", "", ""),
        ("start() one by one (runs/s)", f"{ours['start_per_s']:.0f}", get("start_per_s"),
         ratio(ours["start_per_s"], "start_per_s"), ""),
        ("start_many(), one transaction (runs/s)", f"{ours['start_many_per_s']:.0f}",
         f"(start_workflow: {get('start_per_s')})", ratio(ours["start_many_per_s"], "start_per_s"),
         "10x DBOS's start rate"),
        ("sleepers: wake lateness p50 / p99 (ms)", late, peer_late, "", "p99 <= 30"),
        ("sleepers: worker threads added (asleep / waking)",
         f"{ours['sleep_threads_added']:.0f} / {ours['wake_threads_added']:.0f}",
         get("sleep_threads_added"), "", "no thread per sleeper"),
        ("sleepers: worker RSS added, MB (asleep / waking)",
         f"{ours['sleep_rss_added_mb']:.1f} / {ours['wake_rss_added_mb']:.1f}",
         get("sleep_rss_added_mb"), "", "<= 50"),
    ]  # fmt: skip
    return [*default, *opt_in]


def report(ours: dict[str, float], peer: dict[str, float]) -> None:
    """Print the results as a markdown table (what docs/benchmarks.md takes)."""
    print("\n| metric | durable | DBOS | durable / DBOS | target |\n|---|---|---|---|---|")
    for cells in _rows(ours, peer):
        print("| " + " | ".join(cells) + " |")
    print(f"\nload average at the end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
