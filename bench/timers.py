"""Benchmark: durable's timers against Procrastinate and a naive poller, on one PostgreSQL.

    python bench/timers.py                       # full run (15-25 min on a shared 2-core box)
    python bench/timers.py --quick               # small sizes, about 2 minutes
    python bench/timers.py --only burst,takeover # some sections
    python bench/timers.py --markdown out.md     # also write the final table

Sections (``--only`` names): ``schedule`` (single and bulk scheduling rates),
``throughput`` (one worker draining timers all due at once, no-op and row-writing
handlers), ``lateness`` (steady 2,000 timers/s with 1M pending), ``burst`` (20,000 timers
due within one 10 s window), ``takeover`` (SIGKILL of a real worker, a second one takes
over), ``rebuild`` (a new owner loading a shard of 1M near-term timers), ``rss`` (worker
memory with 1M timers in the horizon and 5M timers 30 days out).

How each contender runs:

* durable: ``Engine.run()`` (the loop ``manage.py run_timer_shards`` runs) in a thread of
  this process, so handlers can record lateness in memory; ``takeover`` and ``rss`` use
  real ``manage.py run_timer_shards`` subprocesses. Settings are the defaults (64 shards,
  batches of 500, lease TTL 10 s) with ``DEBUG=False``.
* Procrastinate: see ``bench/peers/procrastinate_peer.py`` (async tasks, concurrency 8,
  LISTEN/NOTIFY on, 0.1 s polling), its own database on the same server.
* naive: see ``bench/peers/naive_poller.py`` (100 ms polling, batches of 500,
  ``FOR UPDATE SKIP LOCKED``), a table in durable's database.

Lateness is always the wall clock when the handler starts minus the due time, in ms. The
peers run one at a time, never concurrently. Large set-ups (1M and 5M pending rows) are
inserted with ``INSERT ... SELECT generate_series`` straight into the tables: a benchmark
shortcut, the rows are what the public API writes.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (
    DURABLE_URL,
    PROCRASTINATE_URL,
    Lateness,
    Report,
    Row,
    connect,
    fmt_rate,
    hit,
    median,
    quiet_gc,
    rate,
    ratio,
    setup_django,
    wait_until,
    wall_ms,
)

SECTIONS = ("schedule", "throughput", "burst", "lateness", "takeover", "rebuild", "rss")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """How big each section runs."""

    single: int
    bulk: int
    reps: int
    tp_noop: int
    tp_write: int
    proc_tp: int
    lat_pending: int
    lat_seconds: int
    proc_lat_seconds: int
    burst: int
    takeover_trials: int
    takeover_ttl_s: float
    window_ms: int
    rebuild_rows: int
    rss_near: int
    rss_far: int


FULL = Sizes(
    single=2_000, bulk=100_000, reps=3, tp_noop=100_000, tp_write=30_000, proc_tp=3_000,
    lat_pending=1_000_000, lat_seconds=30, proc_lat_seconds=3, burst=20_000, window_ms=10_000,
    takeover_trials=2, takeover_ttl_s=10, rebuild_rows=1_000_000, rss_near=1_000_000,
    rss_far=5_000_000,
)  # fmt: skip
QUICK = Sizes(
    single=100, bulk=5_000, reps=1, tp_noop=10_000, tp_write=2_000, proc_tp=100,
    lat_pending=50_000, lat_seconds=3, proc_lat_seconds=0, burst=1_000, window_ms=2_000,
    takeover_trials=1, takeover_ttl_s=3, rebuild_rows=100_000, rss_near=100_000,
    rss_far=200_000,
)  # fmt: skip

RATE = 2_000  # timers/s for the lateness section


class Bench:
    """Runs the sections and fills the report."""

    def __init__(self, sizes: Sizes, report: Report) -> None:
        from bench.peers import durable_side, naive_poller, procrastinate_peer

        self.s = sizes
        self.r = report
        self.d = durable_side
        self.n = naive_poller
        self.p = procrastinate_peer

    # -- helpers ----------------------------------------------------------------------

    def _durable_drain(self, due: list[int], target: str, timeout_s: float) -> Lateness:
        """Schedule ``due`` with schedule_many while a worker runs; wait for every fire."""
        d = self.d
        d.reset_tables()
        worker = d.EngineThread()
        worker.start()
        d.RECORDER.reset()
        d.schedule_many(due, target=target)
        wait_until(lambda: len(d.RECORDER) >= len(due), timeout_s, 0.01)
        worker.stop()
        fired = d.raw("SELECT count(*) FROM durable_timer WHERE state = 'fired'")[0][0]
        if fired != len(due) or len(d.RECORDER) != len(due):
            self.r.note(f"durable: {fired} of {len(due)} rows fired, {len(d.RECORDER)} calls")
        if target == d.WRITE:
            self._check_effects(lambda sql: d.raw(sql)[0], len(due), "durable")
        return Lateness.of(d.RECORDER.samples)

    def _naive_drain(
        self, due: list[float], handler: str, timeout_s: float, far: int = 0
    ) -> Lateness:
        n = self.n
        self.d.reset_tables()  # empties bench_effect
        n.prepare(DURABLE_URL)
        if far:
            n.insert_far(DURABLE_URL, far)
        poller = n.Poller(DURABLE_URL)
        poller.start()
        n.RECORDER.reset()
        n.insert_copy(DURABLE_URL, due, handler)
        wait_until(lambda: len(n.RECORDER) >= len(due), timeout_s, 0.01)
        poller.stop()
        if handler == "write":
            self._check_effects(lambda sql: self.d.raw(sql)[0], len(due), "naive")
        return Lateness.of(n.RECORDER.samples)

    def _procrastinate_drain(
        self, due: list[float], task: str, timeout_s: float, far: int = 0
    ) -> Lateness:
        p = self.p
        p.prepare(PROCRASTINATE_URL)
        if far:
            p.insert_far(PROCRASTINATE_URL, far)
        scheduler = p.Scheduler(PROCRASTINATE_URL)
        worker = p.WorkerThread(PROCRASTINATE_URL)
        worker.start()
        p.RECORDER.reset()
        scheduler.defer_at(due, task=task)
        wait_until(lambda: len(p.RECORDER) >= len(due), timeout_s, 0.02)
        worker.stop()
        scheduler.close()
        if len(p.RECORDER) < len(due):
            self.r.note(
                f"procrastinate: {len(p.RECORDER)} of {len(due)} jobs ran within {timeout_s:.0f} s"
            )
        return Lateness.of(p.RECORDER.samples)

    def _check_effects(self, one, expected: int, who: str) -> None:  # type: ignore[no-untyped-def]
        rows, distinct = one("SELECT count(*), count(DISTINCT ref) FROM bench_effect")
        if rows != expected or distinct != expected:
            self.r.note(f"{who}: {rows} effect rows, {distinct} distinct, expected {expected}")

    # -- sections ---------------------------------------------------------------------

    def schedule(self) -> None:
        """Scheduling rates: one per transaction, and bulk."""
        from bench._sections import schedule_section

        schedule_section(self)

    def throughput(self) -> None:
        """One worker draining timers that all come due at one instant."""
        s, r = self.s, self.r
        for handler, n, reps in (("noop", s.tp_noop, s.reps), ("write", s.tp_write, 1)):
            rates = []
            for _ in range(reps):
                quiet_gc()
                t0 = int(wall_ms()) + 5_000 + n // 15
                target = self.d.NOOP if handler == "noop" else self.d.WRITE
                lat = self._durable_drain([t0] * n, target, timeout_s=60 + n / 1000)
                rates.append(rate(n, lat.max / 1000))
            ours = median(rates)
            quiet_gc()
            pn = s.proc_tp if handler == "noop" else max(s.proc_tp * 2 // 3, 50)
            t0p = wall_ms() + 3_000
            plat = self._procrastinate_drain([t0p] * pn, handler, timeout_s=60 + pn / 50)
            theirs = rate(plat.n, plat.max / 1000)
            quiet_gc()
            naive_rates = []
            for _ in range(reps):
                t0n = wall_ms() + 2_000 + n / 100
                nlat = self._naive_drain([t0n] * n, handler, timeout_s=60 + n / 1000)
                naive_rates.append(rate(nlat.n, nlat.max / 1000))
            naive = median(naive_rates)
            spread = f" (runs {', '.join(f'{x:,.0f}' for x in rates)})" if reps > 1 else ""
            target_txt, verdict = "", ""
            if handler == "noop":
                target_txt = ">= 15,000/s and >= 20x Procrastinate"
                verdict = hit(ours >= 15_000 and ours >= 20 * theirs)
            r.add(
                Row(
                    "fire throughput, 1 worker",
                    f"{handler} handler, {n:,} due at once (Procrastinate {pn:,})",
                    fmt_rate(ours) + spread,
                    fmt_rate(theirs),
                    fmt_rate(naive),
                    f"{ratio(ours, theirs)} / {ratio(ours, naive)}",
                    target_txt,
                    verdict,
                )
            )

    def burst(self) -> None:
        """20,000 timers due within one 10 s window, scheduled ahead."""
        s = self.s
        rng = random.Random(4)
        window = s.window_ms
        offsets = sorted(rng.uniform(0, window) for _ in range(s.burst))

        quiet_gc()
        t0 = int(wall_ms()) + 4_000 + s.burst // 10
        due = [t0 + int(o) for o in offsets]
        dl = self._durable_drain(due, self.d.NOOP, timeout_s=window / 1000 + 30)
        d_on_time = self.d.RECORDER.fired_by(t0 + window + 500)
        quiet_gc()
        t0n = wall_ms() + 3_000
        ndue = [t0n + o for o in offsets]
        nl = self._naive_drain(ndue, "noop", timeout_s=window / 1000 + 30)
        n_on_time = self.n.RECORDER.fired_by(t0n + window + 500)
        quiet_gc()
        t0p = wall_ms() + 3_000
        pdue = [t0p + o for o in offsets]
        pl = self._procrastinate_drain(pdue, "noop", timeout_s=window / 1000 + 150)
        p_on_time = self.p.RECORDER.fired_by(t0p + window + 500)
        ok = d_on_time == len(due) and dl.p99 <= 100
        self.r.add(
            Row(
                "burst",
                f"{s.burst:,} due uniformly within {window / 1000:.0f} s: fired by window end"
                " + 0.5 s",
                f"{d_on_time:,}/{len(due):,}",
                f"{p_on_time:,}/{len(due):,}",
                f"{n_on_time:,}/{len(due):,}",
                "",
                "all by end + 0.5 s, p99 <= 100 ms",
                hit(ok),
            )
        )
        self.r.add(
            Row(
                "burst",
                "lateness p50 / p99 / max (ms)",
                _lat(dl),
                _lat(pl),
                _lat(nl),
                f"p99 {ratio(pl.p99, dl.p99)} lower than Procrastinate's",
            )
        )

    def lateness(self) -> None:
        """Steady 2,000 timers/s with 1M timers pending (mostly 30 days out)."""
        from bench._sections import lateness_section

        lateness_section(self)

    def takeover(self) -> None:
        """SIGKILL a real worker; a second one waits for lease expiry and takes over."""
        from bench._sections import takeover_section

        takeover_section(self)

    def rebuild(self) -> None:
        """A new owner loading a shard that holds 1M near-term timers."""
        from bench._sections import rebuild_section

        rebuild_section(self)

    def rss(self) -> None:
        """Worker RSS: idle, 1M timers inside the horizon, 5M timers 30 days out."""
        from bench._sections import rss_section

        rss_section(self)


def _lat(lat: Lateness) -> str:
    return f"{lat.p50:,.0f} / {lat.p99:,.0f} / {lat.max:,.0f}" if lat.n else "n/a"


def environment() -> list[str]:
    """What the figures were measured on."""
    import django
    import procrastinate
    import psutil
    import psycopg

    with connect(DURABLE_URL) as conn:
        server = conn.execute("SHOW server_version").fetchone()[0]
        sync = conn.execute("SHOW synchronous_commit").fetchone()[0]
    load = " ".join(f"{x:.2f}" for x in psutil.getloadavg())
    return [
        f"{platform.platform()}, {psutil.cpu_count()} CPUs (shared with other test runs),"
        f" {psutil.virtual_memory().total / 2**30:.0f} GB RAM, load average {load}",
        f"Python {platform.python_version()}, Django {django.__version__}, psycopg "
        f"{psycopg.__version__}, Procrastinate {procrastinate.__version__}, PostgreSQL "
        f"{server} (synchronous_commit={sync}, same host)",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--only", default="", help=f"comma-separated: {','.join(SECTIONS)}")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    only = [x.strip() for x in args.only.split(",") if x.strip()] or list(SECTIONS)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(unknown)}")
    setup_django(DURABLE_URL, DJANGO_DEBUG="false")
    report = Report()
    bench = Bench(QUICK if args.quick else FULL, report)
    env_lines = environment()
    print("\n".join(env_lines), flush=True)
    started = time.monotonic()
    for name in SECTIONS:
        if name in only:
            print(f"== {name}", flush=True)
            t = time.monotonic()
            getattr(bench, name)()
            print(f"   ({time.monotonic() - t:.0f} s)", flush=True)
    for line in env_lines:
        report.note(line)
    report.note(
        f"mode: {'quick' if args.quick else 'full'}; total {time.monotonic() - started:.0f} s"
    )
    table = report.render()
    print("\n" + table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
