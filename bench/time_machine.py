"""Benchmark: a 30-day workflow of 20 steps and 5 sleeps under ``durable.testing.time_machine``.

    python bench/time_machine.py                 # PostgreSQL (its own database)
    python bench/time_machine.py --sqlite        # SQLite (a temporary file)
    python bench/time_machine.py --repeat 20

What a test pays for ``machine.advance(days=30)`` (issue 19's target: under a second):
each repetition starts the workflow and advances 30 days, once inside a transaction
rolled back afterwards (as pytest-django's ``db`` fixture runs a test) and once outside
(``transactional_db``). Prints the median and the worst, and the engine's start-up (the
fixture's set-up: leases of every shard) apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ADMIN = "postgres://durable:durable@127.0.0.1:5432/postgres"
URL = "postgres://durable:durable@127.0.0.1:5432/durable_timemachine_bench"
DAY = timedelta(days=1)


def create_database() -> None:
    import psycopg

    with psycopg.connect(ADMIN, autocommit=True) as conn:
        name = URL.rsplit("/", 1)[1]
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")


def note(key: str) -> str:
    from testproject.demo.models import FireRecord

    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


def thirty_days(ctx, user):  # registered in main(), once Django is set up
    for week in range(5):
        for n in range(4):
            ctx.step(note, f"{user}:{week}:{n}")
        ctx.sleep(6 * DAY)
    return "done"


def trip(workflow, user: str) -> tuple[float, float]:
    """(engine start-up s, advance s) of one run of the workflow through 30 days."""
    from durable.testing import time_machine

    started = time.perf_counter()
    with time_machine() as machine:
        ready = time.perf_counter()
        run = workflow.start(user)
        travelled = machine.advance(days=30)
        done = time.perf_counter()
    assert travelled.completed == [run.pk], str(travelled)
    return ready - started, done - ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sqlite", action="store_true")
    parser.add_argument("--repeat", type=int, default=10)
    options = parser.parse_args()
    if options.sqlite:
        url = f"sqlite:///{tempfile.mkdtemp()}/bench.sqlite3"
    else:
        create_database()
        url = URL
    from bench._common import setup_django

    setup_django(url)
    from django.core.management import call_command
    from django.db import transaction

    import durable

    call_command("migrate", verbosity=0)
    workflow = durable.workflow(name="bench.thirty_days")(thirty_days)

    class Rollback(Exception):
        pass

    wrapped, bare, starts = [], [], []
    for n in range(options.repeat):
        try:
            with transaction.atomic():  # as pytest-django's db fixture
                start, took = trip(workflow, f"w{n}")
                raise Rollback
        except Rollback:
            pass
        wrapped.append(took)
        starts.append(start)
        start, took = trip(workflow, f"b{n}")
        bare.append(took)
        starts.append(start)
    load = Path("/proc/loadavg").read_text().split()[:3]
    vendor = "SQLite" if options.sqlite else "PostgreSQL"
    print(f"{vendor}, {options.repeat} repetitions, load average {' '.join(load)}")
    for label, values in (("in a rolled-back transaction", wrapped), ("outside one", bare)):
        print(
            f"advance(days=30), {label}: median {statistics.median(values) * 1000:.0f} ms, "
            f"max {max(values) * 1000:.0f} ms"
        )
    print(f"engine start-up (64 shards): median {statistics.median(starts) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
