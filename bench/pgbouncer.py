"""Benchmark: lateness at 2,000 fires/s with the worker direct, then behind PgBouncer.

    python bench/pgbouncer.py                 # 20 s at 2,000/s in each topology
    python bench/pgbouncer.py --seconds 10    # shorter
    python bench/pgbouncer.py --markdown out.md
    python bench/pgbouncer.py --producers 2  # fewer scheduling processes
    python bench/pgbouncer.py --preload      # the fire path alone: timers written ahead
    python bench/pgbouncer.py --bulk --producers 2   # each tick's timers in one schedule_many

The table gives the rate actually reached: on a busy machine the producers may fall
short of 2,000/s.

Each run: a real ``manage.py run_timer_shards`` worker and ``--producers`` processes (4)
that together schedule 2,000 timers a second with ``durable.schedule()``, in one
transaction per 10 ms each, every timer due 500 ms after its commit, so every timer is
announced by its own NOTIFY (the rescan, every 2 s, would show as lateness up to 2 s).
The handler (``bench.peers.durable_side.write``) inserts a row stamped with the wall
clock when it starts; lateness = that stamp - the due time. "pgbouncer": worker and
producers connect
through a PgBouncer 1.18 in transaction mode (started here, pool of 20, as the
``postgres`` OS user) and the worker LISTENs directly (``DURABLE_LISTEN_DATABASE_URL``,
``DURABLE["LISTEN_DATABASE"]``); "direct": both connect to PostgreSQL. Database
``durable_pgb_bench`` on the server at 127.0.0.1:5432 (created and migrated if missing).
"direct, unprepared" (``--preload`` only): direct, with the pooled run's settings (the
listen alias, hence no ``prepare_threshold`` and the worker not preparing): what the
unprepared fire path costs without the pooler's hop.

``--preload``: the fire path alone, at the rate asked for whatever the producers manage.
One process writes every timer first (``schedule_many``, 2,000 a transaction, through the
same topology), due at ``--rate`` a second from 8 s after it starts; the worker then fires
them from its wheels (loaded by bucket and by the per-shard notices of those commits).
On a 2-core machine the producers of the default mode compete with the worker for the
CPU; this mode measures what the pooler costs the firing transactions.

``--bulk``: the default mode with each producer's tick written by one ``schedule_many``
(one INSERT, one NOTIFY naming each timer by id) instead of one ``schedule()`` call per
timer: the same timers, due 500 ms after their commit and announced by NOTIFY, for a
fraction of the producers' CPU, so 2,000 a second can be asked for on 2 cores with the
worker beside them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import REPO, Lateness, connect, ratio, server_health, wait_until, wall_ms

DIRECT_URL = "postgres://durable:durable@127.0.0.1:5432/durable_pgb_bench"
TICK_S = 0.01
LEAD_MS = 500


def produce(seconds: float, rate: int, bulk: bool = False) -> None:
    """Producer process: ``rate`` timers a second for ``seconds``, each announced by NOTIFY.

    A commit every ``TICK_S``; ``bulk``: the tick's timers in one ``schedule_many``.
    """
    import django

    django.setup()
    from django.db import transaction

    import durable
    from bench.peers.durable_side import WRITE, to_dt

    per_tick = max(1, round(rate * TICK_S))
    ticks = int(seconds / TICK_S)
    start = time.monotonic()
    ref = 0
    for tick in range(ticks):
        lag = start + tick * TICK_S - time.monotonic()
        if lag > 0:
            time.sleep(lag)
        if bulk:
            due = to_dt(wall_ms() + LEAD_MS)
            durable.schedule_many(
                [{"fn": WRITE, "args": [ref + i], "at": due} for i in range(per_tick)]
            )
            ref += per_tick
            continue
        with transaction.atomic():
            due = to_dt(wall_ms() + LEAD_MS)
            for _ in range(per_tick):
                durable.schedule(WRITE, args=[ref], at=due)
                ref += 1
    print(ref, round(time.monotonic() - start, 2), flush=True)


def preload(seconds: float, rate: int, lead_ms: int) -> None:
    """Preload process: ``seconds * rate`` timers due at ``rate`` a second after ``lead_ms``."""
    import django

    django.setup()
    import durable
    from bench.peers.durable_side import WRITE, to_dt

    total = int(seconds * rate)
    first = wall_ms() + lead_ms
    for start in range(0, total, 2_000):
        durable.schedule_many(
            [
                {"fn": WRITE, "args": [ref], "at": to_dt(first + ref * 1000 / rate)}
                for ref in range(start, min(total, start + 2_000))
            ]
        )
    print(total, round((wall_ms() - first + lead_ms) / 1000, 2), flush=True)


def prepare_database() -> None:
    """Create and migrate the benchmark database if needed; the effect table too."""
    with connect(DIRECT_URL.rsplit("/", 1)[0] + "/postgres") as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = 'durable_pgb_bench'"
        ).fetchone()
        if not exists:
            conn.execute("CREATE DATABASE durable_pgb_bench")
    env = {
        **os.environ,
        "DATABASE_URL": DIRECT_URL,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=REPO,
        env=env,
        check=True,
    )


def reset(url: str) -> None:
    """Empty timers, nodes and effects; free every lease."""
    from bench.peers.durable_side import EFFECT_DDL

    with connect(url) as conn:
        conn.execute(EFFECT_DDL)
        conn.execute("TRUNCATE durable_timer, durable_workernode, bench_effect CASCADE")
        conn.execute("UPDATE durable_shardlease SET owner = '', expires_at = NULL, cursor_ms = 0")
        conn.execute("VACUUM ANALYZE durable_timer")


def run(
    name: str,
    url: str,
    env: dict[str, str],
    seconds: float,
    rate: int,
    processes: int,
    preloaded: bool = False,
    bulk: bool = False,
) -> tuple[Lateness, float]:
    """One topology: a worker, the producer, then every fire's lateness."""
    from bench._worker_proc import WorkerProcess

    reset(DIRECT_URL)
    worker = WorkerProcess(url, f"pgb-{name}", **env)
    try:
        worker.wait_owning(64)
        time.sleep(2.0)  # let it load every shard's buckets
        # Several producer processes: one Python process schedules only a few hundred
        # timers a second with a commit (and a NOTIFY) per 20 on a shared 2-core box.
        env = {
            **os.environ,
            "DATABASE_URL": url,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DJANGO_DEBUG": "false",
            **env,
        }
        if preloaded:
            commands = [[sys.executable, __file__, "--preload", str(seconds), str(rate)]]
        else:
            share = str(rate // processes)
            produce = [sys.executable, __file__, "--produce", str(seconds), share]
            commands = [produce + (["--bulk"] if bulk else [])] * processes
        producers = [
            subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
            for command in commands
        ]
        outputs = [p.communicate()[0] for p in producers]
        assert all(p.returncode == 0 for p in producers), outputs
        total = sum(int(out.split()[0]) for out in outputs)
        # Preloaded: fired at the rate asked for, over the window; otherwise the
        # producers' own window, without their processes' start-up.
        took = seconds if preloaded else max(float(out.split()[1]) for out in outputs)
        with connect(DIRECT_URL) as conn:

            def count() -> int:
                return int(conn.execute("SELECT count(*) FROM bench_effect").fetchone()[0])

            wait_until(
                lambda: count() >= total,
                timeout_s=60 + (12 if preloaded else 0) + seconds,
                every_s=0.2,
            )
            rows = conn.execute("SELECT fired_ms - due_ms FROM bench_effect").fetchall()
    finally:
        worker.stop()
    lateness = Lateness.of([float(r[0]) for r in rows])
    late = sum(1 for (r,) in rows if r > 1_000)
    print(
        f"{name:10} {lateness} of {total:,} scheduled; {late} later than 1 s "
        f"in {took:.1f} s: {total / took:,.0f} scheduled/s by {processes} producers",
        flush=True,
    )
    return lateness, total / took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=2_000)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--producers", type=int, default=4, help="producer processes")
    parser.add_argument(
        "--preload", action="store_true", help="write every timer first: the fire path alone"
    )
    parser.add_argument(
        "--bulk", action="store_true", help="producers write each tick with one schedule_many"
    )
    parser.add_argument("--produce", nargs=2, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.produce:
        produce(float(args.produce[0]), int(args.produce[1]), args.bulk)
        return
    if args.preload and rest:  # the preload process: --preload SECONDS RATE
        preload(float(rest[0]), int(rest[1]), lead_ms=8_000)
        return
    from durable.testing.cluster import TemporaryPgBouncer

    prepare_database()
    before = server_health(DIRECT_URL)
    print(f"server before: {before}", flush=True)
    bouncer = TemporaryPgBouncer(users={"durable": "durable"}, pool_size=20)
    bouncer.start()
    common = (args.seconds, args.rate, args.producers, args.preload, args.bulk)
    try:
        pooled = bouncer.url("durable_pgb_bench", "durable", "durable")
        direct, direct_rate = run("direct", DIRECT_URL, {}, *common)
        listen = {"DURABLE_LISTEN_DATABASE_URL": DIRECT_URL}
        unprepared = None
        if args.preload:  # the pooled run's settings without the pooler
            unprepared = run("unprepared", DIRECT_URL, listen, *common)
        behind, behind_rate = run("pgbouncer", pooled, listen, *common)
    finally:
        bouncer.destroy()
    verdict = "hit" if behind.p99 <= 2 * direct.p99 else "missed"
    mode = (
        "preloaded"
        if args.preload
        else f"scheduled while firing{', schedule_many a tick' if args.bulk else ''}"
    )
    lines = [
        f"| topology ({mode}) | fired per s | lateness p50 / p99 / max (ms) | fires |",
        "|---|---|---|---|",
        f"| direct | {direct_rate:,.0f} | {direct.p50:.1f} / {direct.p99:.1f} / "
        f"{direct.max:.1f} | {direct.n:,} |",
        *(
            [
                f"| direct, unprepared (the pooled run's settings) | {unprepared[1]:,.0f} | "
                f"{unprepared[0].p50:.1f} / {unprepared[0].p99:.1f} / {unprepared[0].max:.1f} "
                f"| {unprepared[0].n:,} |"
            ]
            if unprepared
            else []
        ),
        f"| PgBouncer 1.18, transaction mode | {behind_rate:,.0f} | {behind.p50:.1f} / "
        f"{behind.p99:.1f} / {behind.max:.1f} | {behind.n:,} |",
        "",
        f"p99 through PgBouncer / direct: {ratio(behind.p99, direct.p99)} "
        f"(target: within 2x, {verdict}; asked for {args.rate:,}/s)",
    ]
    lines.append(f"load average at the end: {Path('/proc/loadavg').read_text().strip()}")
    lines.append(f"server before: {before}; after: {server_health(DIRECT_URL)}")
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
