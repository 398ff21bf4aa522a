"""What one no-op fire costs in a drain, by side: worker CPU, server CPU, statements, WAL.

The no-op drain of ``bench/timers.py --only throughput`` (N timers due at one instant, one
in-process worker, defaults) without the peers, for comparing two trees back to back on
a shared machine, where the wall-clock rate says more about the load than the code
(issue 16, docs/benchmarks.md). Run it from the root of the tree to measure, with that
tree's virtualenv; it works on trees back to issue 4's benchmark (``bench/_common.py``):

    DRAIN_URL=postgres://durable:durable@127.0.0.1:5432/durable_drain \
        python bench/drain_cost.py [--n 100000] [--reps 3] [--main] [--pgss] [--profile F]

Per run it prints the rate (N / the last timer's lateness), the CPU the worker's loop
thread spent per fired timer (from ``/proc``), the CPU of the server backends serving the
database (``/proc``, so run it as a user who can read them) and of the WAL writer,
checkpointer and background writer. ``--main`` runs the loop on the main thread, as
``run_timer_shards`` does (atomic handlers' ``SIGALRM`` deadlines on); by default it runs
in a thread, as ``bench/timers.py`` does. ``--pgss`` resets ``pg_stat_statements`` when
the drain starts and prints, per statement, calls and per fired timer the execution and
planning time, WAL records and bytes and buffers (the server must preload it and the
database have the extension; the reset connects as ``postgres``). ``--naive`` also
drains the naive poller. ``--profile F`` writes a CPU-time cProfile of the loop thread.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
DURABLE_URL = os.environ["DRAIN_URL"]

from bench._common import quiet_gc, rate, setup_django, wait_until, wall_ms  # noqa: E402


def backend_cpu(dbname: str) -> float:
    """Summed utime+stime (s) of every postgres process serving ``dbname`` (by cmdline)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b" durable " + dbname.encode() + b" " not in cmd:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return total / tick


def walsender_cpu() -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if not any(x in cmd for x in (b"walwriter", b"checkpointer", b"background writer")):
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return total / tick


def _admin():
    import psycopg

    return psycopg.connect(DURABLE_URL.replace("durable:durable@", "postgres@"), autocommit=True)


def pgss_reset() -> None:
    with _admin() as c:
        c.execute("SELECT pg_stat_statements_reset()")


def pgss_dump(n: int) -> None:
    """Print pg_stat_statements since the reset, per fired timer (``n``)."""
    with _admin() as c:
        rows = c.execute(
            "SELECT calls, total_exec_time, total_plan_time, rows, wal_records, wal_bytes, "
            "shared_blks_hit + shared_blks_read, shared_blks_dirtied, query "
            "FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC"
        ).fetchall()
    heads = ("calls", "exec us/t", "plan us/t", "rows", "walrec/t", "walB/t", "blks/t", "dirt/t")
    widths = (7, 9, 9, 8, 8, 7, 6, 6)
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, widths, strict=True)), " query")
    tot = [0.0] * 8
    for r in rows:
        for i in range(8):
            tot[i] += float(r[i])
        if r[1] * 1000 / n < 0.05 and r[0] < 10:
            continue
        print(_row(r[:8], n), "", " ".join(r[8].split())[:150])
    print(_row(tot, n), "", "TOTAL", flush=True)


def _row(r, n):  # type: ignore[no-untyped-def]
    calls, execs, plans, rows, recs, wal, blks, dirt = (float(x) for x in r)
    return (
        f"{calls:>7.0f} {execs * 1000 / n:>9.2f} {plans * 1000 / n:>9.2f} {rows:>8.0f} "
        f"{recs / n:>8.2f} {wal / n:>7.0f} {blks / n:>6.2f} {dirt / n:>6.3f}"
    )


def main_thread_run(a, d, n, dbname):  # type: ignore[no-untyped-def]
    from durable.conf import get_settings
    from durable.worker.engine import Engine

    quiet_gc()
    d.reset_tables()
    engine = Engine(node="bench-main", threads=1)
    tid = threading.get_native_id()
    out: dict = {}

    def tcpu() -> float:
        f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def side() -> None:
        from django.db import connections

        try:
            while len(engine.runners) < get_settings().SHARDS:
                time.sleep(0.01)
            d.RECORDER.reset()
            t0 = int(wall_ms()) + 5_000 + n // 15
            d.schedule_many([t0] * n, target=d.WRITE if a.write else d.NOOP)
            while wall_ms() < t0 - 300:
                time.sleep(0.05)
            c0, b0 = tcpu(), backend_cpu(dbname)
            wait_until(lambda: len(d.RECORDER) >= n, 60 + n / 1000, 0.01)
            c1, b1 = tcpu(), backend_cpu(dbname)
            out.update(c=(c1 - c0), b=(b1 - b0))
        finally:
            connections.close_all()
            engine.stop()

    t = threading.Thread(target=side, daemon=True)
    t.start()
    engine.run()
    t.join()
    samples = list(d.RECORDER.samples)
    lat_max = max(samples)
    print(
        f"durable (main thread) : {rate(n, lat_max / 1000):,.0f}/s  max lateness {lat_max:.0f} ms"
        f"  engine-thread CPU {out['c'] * 1e6 / n:.1f} us/timer  backends "
        f"{out['b'] * 1e6 / n:.1f} us/timer  load {os.getloadavg()[0]:.2f}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--profile")
    p.add_argument("--naive", action="store_true")
    p.add_argument("--naive-only", action="store_true")
    p.add_argument("--main", action="store_true", help="engine on the main thread (SIGALRM)")
    p.add_argument("--write", action="store_true")
    p.add_argument("--pgss", action="store_true", help="reset/dump pg_stat_statements")
    a = p.parse_args()
    setup_django(DURABLE_URL)
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from bench.peers import durable_side as d
    from bench.peers import naive_poller as nv

    dbname = DURABLE_URL.rsplit("/", 1)[1]
    print("load", os.getloadavg(), flush=True)
    n = a.n
    if a.main:
        for _ in range(a.reps):
            main_thread_run(a, d, n, dbname)
        return
    for rep in range(0 if a.naive_only else a.reps):
        quiet_gc()
        d.reset_tables()
        worker = d.EngineThread()
        holder: dict = {}
        orig = worker.engine.run

        def run(orig=orig, holder=holder):
            holder["tid"] = threading.get_native_id()
            prof = cProfile.Profile(time.thread_time) if a.profile else None
            if prof:
                prof.enable()
            try:
                orig()
            finally:
                if prof:
                    prof.disable()
                    prof.dump_stats(a.profile)
                holder["cpu"] = time.thread_time()

        worker.engine.run = run
        worker.start()
        d.RECORDER.reset()
        t0 = int(wall_ms()) + 5_000 + n // 15
        d.schedule_many([t0] * n, target=d.WRITE if a.write else d.NOOP)
        while wall_ms() < t0 - 300:
            time.sleep(0.05)
        tid = holder["tid"]

        def tcpu(tid: int = tid) -> float:
            f = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

        if a.pgss:
            pgss_reset()
        c0, b0, w0, p0 = tcpu(), backend_cpu(dbname), walsender_cpu(), time.process_time()
        wait_until(lambda: len(d.RECORDER) >= n, 60 + n / 1000, 0.01)
        c1, b1, w1, p1 = tcpu(), backend_cpu(dbname), walsender_cpu(), time.process_time()
        if a.pgss:
            pgss_dump(n)
        samples = list(d.RECORDER.samples)
        worker.stop()
        lat_max = max(samples)
        r = rate(n, lat_max / 1000)
        print(
            f"durable run {rep}: {r:,.0f}/s  max lateness {lat_max:.0f} ms  engine-thread CPU "
            f"{(c1 - c0) * 1e6 / n:.1f} us/timer  backends {(b1 - b0) * 1e6 / n:.1f} us/timer  "
            f"wal/ckpt/bgw {(w1 - w0) * 1e6 / n:.1f} us/timer  process {(p1 - p0) * 1e6 / n:.1f} "
            f"us/timer  load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    if a.naive or a.naive_only:
        for rep in range(a.reps):
            quiet_gc()
            d.reset_tables()
            nv.prepare(DURABLE_URL)
            poller = nv.Poller(DURABLE_URL)
            poller.start()
            nv.RECORDER.reset()
            t0n = wall_ms() + 2_000 + n / 100
            nv.insert_copy(DURABLE_URL, [t0n] * n, "write" if a.write else "noop")
            if a.pgss:
                pgss_reset()
            b0 = backend_cpu(dbname)
            wait_until(lambda: len(nv.RECORDER) >= n, 60 + n / 1000, 0.01)
            b1 = backend_cpu(dbname)
            if a.pgss:
                pgss_dump(n)
            poller.stop()
            lat_max = max(nv.RECORDER.samples)
            print(
                f"naive run {rep}: {rate(n, lat_max / 1000):,.0f}/s  backends (incl. insert "
                f"wait) {(b1 - b0) * 1e6 / n:.1f} us/timer  load {os.getloadavg()[0]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
