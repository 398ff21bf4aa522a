"""Benchmark: ``manage.py durable_check_runs``, dry replays of recorded runs per second.

    python bench/check_runs.py                 # 20,000 runs
    python bench/check_runs.py --runs 5000     # fewer

Fills its own database (``durable_checkruns_bench``, dropped and created) with unfinished
runs of the demo's ``onboarding`` workflow waiting for their ``first-order`` signal, each
with the 7 recorded calls of ``tests/histories/onboarding_v2.json`` (steps, a patch
marker, ``now``, a finished sleep, the signal wait), written directly with
``bulk_create`` (running them would take far longer than checking them). Then it times
the check twice: ``check_runs()`` in this process (the replay rate: reads and replays,
Django set-up excluded) and the real command in a subprocess (wall time, start-up
included). Target (issue 19): >= 5,000 runs a second.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ADMIN = "postgres://durable:durable@127.0.0.1:5432/postgres"
URL = "postgres://durable:durable@127.0.0.1:5432/durable_checkruns_bench"
HISTORY = REPO / "tests" / "histories" / "onboarding_v2.json"


def create_database() -> None:
    import psycopg

    with psycopg.connect(ADMIN, autocommit=True) as conn:
        name = URL.rsplit("/", 1)[1]
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")


def fill(runs: int) -> None:
    from django.core.management import call_command

    from durable.conf import get_settings
    from durable.core.sharding import shard_for
    from durable.models import WorkflowRun, WorkflowStep

    call_command("migrate", verbosity=0)
    history = json.loads(HISTORY.read_text())
    steps = history["steps"]
    waiting = {**steps[-1], "status": "waiting", "result": None}  # the signal not sent yet
    shards = get_settings().SHARDS
    for first in range(0, runs, 2000):
        batch = [uuid.uuid4().hex for _ in range(first, min(runs, first + 2000))]
        WorkflowRun.objects.bulk_create(
            WorkflowRun(
                id=run_id, name=history["workflow"], state="waiting",
                shard=shard_for(run_id, shards), args=[f"user{n}@example.com"], kwargs={},
                wait_signal="first-order", wait_seq=6,
            )
            for n, run_id in enumerate(batch, first)
        )  # fmt: skip
        WorkflowStep.objects.bulk_create(
            WorkflowStep(run_id=run_id, **{"error": "", "attempts": 0, "wake_ms": None, **step})
            for run_id in batch
            for step in [*steps[:-1], waiting]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    options = parser.parse_args()
    create_database()
    from bench._common import setup_django

    setup_django(URL)
    started = time.perf_counter()
    fill(options.runs)
    print(f"filled {options.runs} runs in {time.perf_counter() - started:.1f} s")

    from durable.discovery import discover
    from durable.workflows.checkruns import check_runs

    discover()
    cpu = time.process_time()
    in_process = check_runs()
    cpu = time.process_time() - cpu  # this process's threads: reads and replays, not the server
    assert in_process.checked == options.runs and in_process.ok, in_process.to_json()
    rate = in_process.checked / in_process.seconds
    env = {**os.environ, "DATABASE_URL": URL, "DURABLE_LOG_LEVEL": "WARNING"}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "manage.py", "durable_check_runs"],
        cwd=REPO, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stdout + done.stderr
    load = Path("/proc/loadavg").read_text().split()[:3]
    took = f"{in_process.seconds:.2f} s"
    print(f"check_runs(): {in_process.checked} runs in {took} = {rate:,.0f} runs/s")
    print(
        f"  CPU of this process: {cpu:.2f} s = {in_process.checked / cpu:,.0f} runs per CPU second"
    )
    print(f"manage.py durable_check_runs: {wall:.2f} s wall (Django start-up included)")
    print(f"  its own line: {done.stdout.strip().splitlines()[-1]}")
    print(f"load average: {' '.join(load)}")
    result = {"runs": options.runs, "per_s": round(rate), "command_wall_s": round(wall, 2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
