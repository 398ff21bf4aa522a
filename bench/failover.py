"""Benchmark: failover after SIGKILL of a shard owner, leases only and with Raft (issue 17).

    python bench/failover.py                        # 1M timers in the horizon, every measure
    python bench/failover.py --timers 100000        # scaled down
    python bench/failover.py --only failover --modes ttl10,ttl2
    python bench/failover.py --markdown out.md

Each measure is a function; the modes are (a) ``ttl10``: leases only, ``LEASE_TTL_S`` 10 s
(the default), (b) ``ttl2``: leases only, 2 s, (c) ``raft``: Raft on (TTL 10 s), skipped
with the reason when this checkout's worker cannot run Raft.

``failover``: three real ``run_timer_shards`` processes on database
``durable_failover_bench`` (``BENCH_FAILOVER_DB``; created and migrated if missing),
``--timers`` pending timers in the wheels' horizon (3 to 58 min out, never due during the
run), a stream of ``--rate`` no-op timers a second due from 5 s after the nodes are ready,
and 200 workflow runs asleep (``tests.acceptance.workflows.sleep_then_record``) whose
wake-ups are due 0.3-1.0 s after the kill. 3 s into the stream the node holding the most
shards is SIGKILLed (three nodes share the shards fairly, so it holds 21 or 22). Figures:
from the kill to the last overdue timer of its shards fired (overdue: due before its shard's
new owner fired anything there), to the last of its runs resumed (recorded its wake-up), the
worst lateness, and lost/doubled/early counts. A timer's fire time is the ``fired_at`` its
batch stamps; a run's is the wall clock its atomic step records.

``lateness``: the same three nodes, 2,000 write timers a second (``--lat-seconds``), p99
of (fired - due); with Raft on, also the followers' replication lag
(``durable_raft_replication_lag_seconds``, scraped from each node's ``/metrics`` twice a
second). ``idle``: CPU of each idle node over ``--idle-s``. ``memory``: RSS of each node with
``--timers`` loaded, against idle (with Raft on, the standbys add to it). ``standby``, in
this process: ``--timers`` in an owner's wheel against a follower's standby
(:mod:`bench._standby`). ``--raft-tuning`` adds Raft modes with other settings (the curve
of idle CPU against failover time). The machine is shared and has 2 cores: the load
average is printed with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._cluster import LagWatch, Mode, cluster, cpu_percent, rss_mb, wait_spread
from bench._common import REPO, Lateness, connect, setup_django, wait_until, wall_ms

#: ``BENCH_FAILOVER_DB`` names another database (one per person benching at once).
URL = "postgres://durable:durable@127.0.0.1:5432/" + os.environ.get(
    "BENCH_FAILOVER_DB", "durable_failover_bench"
)
MODES = {
    "ttl10": Mode("ttl10", "(a) leases only, LEASE_TTL_S 10 s", 10.0, None),
    # A TTL of 2 s needs the batch budget and the rescan below it (check durable.E005).
    "ttl2": Mode(
        "ttl2",
        "(b) leases only, LEASE_TTL_S 2 s (BATCH_TIME_BUDGET_S and RESCAN_INTERVAL_S 1 s)",
        2.0,
        None,
        {"DURABLE_BATCH_TIME_BUDGET_S": "1", "DURABLE_RESCAN_INTERVAL_S": "1"},
    ),
    "raft": Mode("raft", "(c) Raft on (default Raft tuning), LEASE_TTL_S 10 s", 10.0, {}),
}
MEASURES = ("failover", "lateness", "idle", "memory", "standby")
RUNS = 200


def load() -> str:
    """The 1-minute load average, for beside every figure."""
    return Path("/proc/loadavg").read_text().split()[0]


def prepare_database() -> None:
    """Create and migrate the benchmark database if needed."""
    with connect(URL.rsplit("/", 1)[0] + "/postgres") as conn:
        name = URL.rsplit("/", 1)[1]
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
    env = {**os.environ, "DATABASE_URL": URL, "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    migrate = [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"]
    subprocess.run(migrate, cwd=REPO, env=env, check=True)


def reset() -> None:
    """Empty timers, runs, nodes and effects; free every lease."""
    from bench.peers.durable_side import EFFECT_DDL

    with connect(URL) as conn:
        conn.execute(EFFECT_DDL)
        conn.execute(
            "TRUNCATE durable_timer, durable_workflowrun, durable_workernode, demo_firerecord,"
            " bench_effect CASCADE"
        )
        conn.execute("UPDATE durable_shardlease SET owner = '', expires_at = NULL, cursor_ms = 0")
        conn.execute("VACUUM ANALYZE durable_timer")


def fill_horizon(n: int) -> None:
    """``n`` pending no-op timers 3 to 58 minutes out: in the wheels, never due in the run."""
    from bench.peers.durable_side import raw, sql_insert

    if n > 0:
        sql_insert(n, int(wall_ms()) + 180_000, 55 * 60_000 / n)
        raw("ANALYZE durable_timer")


def unavailable(mode: Mode) -> str | None:
    """Why ``mode`` cannot run here, or None."""
    if mode.raft is None:
        return None
    from durable.testing.nodes import raft_unavailable_reason

    return raft_unavailable_reason()


# --- failover after SIGKILL -----------------------------------------------------------------


def failover(mode: Mode, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """SIGKILL the node holding the most shards; how long until its backlog fired."""
    from bench.peers.durable_side import NOOP, raw, schedule_many
    from durable.conf import get_settings
    from tests.acceptance.workflows import sleep_then_record

    shards = get_settings().SHARDS
    reset()
    stream = int(args.rate * args.stream_s)
    fill_horizon(max(0, args.timers - stream))
    with cluster(URL, mode, log_dir) as pool:
        ready_s = wait_spread(URL, pool, shards)
        first = int(wall_ms()) + 5_000
        schedule_many([first + i * 1000 // args.rate for i in range(stream)], NOOP)
        # Writing the stream can outlast its lead on a loaded machine: the kill waits for
        # 3 s of it, and for the runs to be written and asleep.
        kill_at = max(first + 3_000, int(wall_ms()) + 4_000)
        for i in range(RUNS):  # asleep until 0.3-1.0 s after the kill
            wake = kill_at + 300 + i * 700 // RUNS
            sleep_then_record.start(f"r{i}", max(0.5, (wake - wall_ms()) / 1000))
        rss = rss_mb(pool)
        time.sleep(max(0.0, (kill_at - wall_ms()) / 1000))
        held = owners_now()
        victim = max(held, key=lambda name: len(held[name]))
        tokens = held[victim]
        kill_ms = wall_ms()
        pool.kill(victim)
        done = wait_until(
            lambda: (
                int(raw("SELECT count(*) FROM durable_timer WHERE state <> 'fired'")[0][0])
                <= max(0, args.timers - stream)
                and int(raw("SELECT count(*) FROM demo_firerecord")[0][0]) >= RUNS
            ),
            timeout_s=mode.ttl_s + 120,
            every_s=0.2,
        )
    rows = raw(
        "SELECT shard, fire_at_ms, extract(epoch FROM fired_at) * 1000, fired_token, attempts"
        " FROM durable_timer WHERE kind = 'handler' AND fire_at_ms < %s",
        [first + stream * 1000 // args.rate + 1],
    )
    runs = raw(
        "SELECT r.shard, f.key, f.fired_at_ms, f.due_at_ms FROM demo_firerecord f"
        " JOIN durable_workflowrun r ON r.args->>0 = f.key"
    )
    extra = {"ready_s": ready_s, "done": done, "rss": rss, "stream": stream}
    return summarise(mode, tokens, kill_ms, rows, runs, **extra)


def owners_now() -> dict[str, dict[int, int]]:
    """Live owners of the benchmark database's leases."""
    from bench._cluster import owners

    return owners(URL)


def summarise(
    mode: Mode,
    tokens: dict[int, int],
    kill_ms: float,
    rows: list[tuple[Any, ...]],
    runs: list[tuple[Any, ...]],
    **extra: Any,
) -> dict[str, Any]:
    """The figures of one failover run."""
    fired = [(sh, due, float(f), tok, att) for sh, due, f, tok, att in rows if f is not None]
    new_owner = [(sh, due, f) for sh, due, f, tok, _ in fired if sh in tokens and tok != tokens[sh]]
    firsts: dict[int, float] = {}
    for sh, _, f in new_owner:
        firsts[sh] = min(f, firsts.get(sh, f))
    backlog = [(due, f) for sh, due, f in new_owner if due <= firsts[sh]]
    victim_runs = [(f, due) for sh, _, f, due in runs if sh in tokens]
    keys = [key for _, key, _, _ in runs]
    return {
        "mode": mode.label,
        "victim_shards": len(tokens),
        "shards_taken_over": len(firsts),
        "last_shard_first_fire_s": (max(firsts.values()) - kill_ms) / 1000 if firsts else None,
        "overdue_timers": len(backlog),
        "last_overdue_fired_s": (max(f for _, f in backlog) - kill_ms) / 1000 if backlog else None,
        "worst_lateness_s": max((f - max(d, kill_ms) for d, f in backlog), default=0) / 1000,
        "victim_runs": len(victim_runs),
        "last_run_resumed_s": (
            (max(f for f, _ in victim_runs) - kill_ms) / 1000 if victim_runs else None
        ),
        "worst_run_lateness_s": max((f - d for f, d in victim_runs), default=0) / 1000,
        "timers_not_fired": extra["stream"] - len(fired),
        "timers_attempted_twice": sum(1 for *_, att in fired if att != 1),
        "early_fires": sum(1 for _, due, f, _, _ in fired if f < due),
        "runs_recorded": len(set(keys)),
        "runs_doubled": len(keys) - len(set(keys)),
        "all_done": extra["done"],
        "ready_s": round(extra["ready_s"], 1),
        "rss_mb_before_kill": {k: round(v) for k, v in extra["rss"].items()},
        "load": load(),
    }


# --- lateness, idle CPU, memory ---------------------------------------------------------------


def lateness(mode: Mode, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """p99 lateness of 2,000 write timers a second fired by the three nodes."""
    from bench.peers.durable_side import WRITE, raw, schedule_many
    from durable.conf import get_settings

    reset()
    total = int(args.lat_rate * args.lat_seconds)
    with cluster(URL, mode, log_dir) as pool:
        wait_spread(URL, pool, get_settings().SHARDS)
        first = int(wall_ms()) + 12_000  # time to write them all first (NOTIFY per commit)
        took = schedule_many([first + i * 1000 // args.lat_rate for i in range(total)], WRITE)
        with LagWatch(pool) as lag:  # Raft on: how far behind the followers apply
            wait_until(
                lambda: int(raw("SELECT count(*) FROM bench_effect")[0][0]) >= total,
                timeout_s=args.lat_seconds + 90,
                every_s=0.2,
            )
        rows = raw("SELECT fired_ms - due_ms FROM bench_effect")
    lat = Lateness.of([float(r[0]) for r in rows])
    return {
        "mode": mode.label,
        "fires": lat.n,
        "of": total,
        "p50_ms": round(lat.p50, 1),
        "p99_ms": round(lat.p99, 1),
        "max_ms": round(lat.max, 1),
        "later_than_1s": sum(1 for (r,) in rows if r > 1_000),
        "scheduling_s": round(took, 1),
        "replication_lag_p99_s": (
            round(Lateness.of(lag.samples).p99, 3) if lag.samples else "n/a (Raft off)"
        ),
        "replication_lag_max_s": round(max(lag.samples), 3) if lag.samples else "n/a",
        "load": load(),
    }


def idle(mode: Mode, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """CPU of each of three idle nodes (no timers) over ``--idle-s``; and their RSS."""
    from durable.conf import get_settings

    reset()
    with cluster(URL, mode, log_dir) as pool:
        wait_spread(URL, pool, get_settings().SHARDS)
        time.sleep(3)  # past start-up
        cpu = cpu_percent(pool, args.idle_s)
        rss = rss_mb(pool)
    return {
        "mode": mode.label,
        "cpu_percent_of_a_core": {k: round(v, 1) for k, v in cpu.items()},
        "rss_mb": {k: round(v) for k, v in rss.items()},
        "load": load(),
    }


def memory(mode: Mode, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """RSS of each node with ``--timers`` in the horizon (owner wheels, and standbys with Raft)."""
    from durable.conf import get_settings

    reset()
    fill_horizon(args.timers)
    with cluster(URL, mode, log_dir) as pool:
        wait_spread(URL, pool, get_settings().SHARDS)
        time.sleep(5)  # let the loads and any replication settle
        rss = rss_mb(pool)
    return {
        "mode": mode.label,
        "timers": args.timers,
        "rss_mb": {k: round(v) for k, v in rss.items()},
        "load": load(),
    }


def standby(mode: Mode, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """An owner's wheel against a follower's standby, ``--timers`` each (in this process)."""
    from bench._standby import standby_against_wheel

    return standby_against_wheel(args.timers)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--timers", type=int, default=1_000_000, help="pending in the horizon")
    parser.add_argument("--rate", type=int, default=1_000, help="due timers a second")
    parser.add_argument("--stream-s", type=float, default=30.0, help="seconds of due timers")
    parser.add_argument("--lat-rate", type=int, default=2_000)
    parser.add_argument("--lat-seconds", type=float, default=20.0)
    parser.add_argument("--idle-s", type=float, default=30.0)
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {','.join(MODES)}")
    parser.add_argument("--only", default=",".join(MEASURES), help=f"of {','.join(MEASURES)}")
    parser.add_argument(
        "--raft-tuning",
        type=json.loads,
        default=[],
        help='more Raft modes, as a JSON list of DURABLE["RAFT"] tunings: '
        '\'[{"HEARTBEAT_S": 0.15}, {"TICK_S": 0.075, "HEARTBEAT_S": 0.15}]\'',
    )
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    modes = [MODES[k] for k in args.modes.split(",") if k]
    for tuning in args.raft_tuning:  # the curve of idle CPU against failover time
        label = "Raft on, " + ", ".join(f"{k} {v}" for k, v in tuning.items())
        modes.append(Mode("raft", label, 10.0, tuning))
    measures = args.only.split(",")
    unknown = set(measures) - set(MEASURES)
    if unknown:
        parser.error(f"unknown measure(s) {sorted(unknown)}; known: {', '.join(MEASURES)}")
    prepare_database()
    setup_django(URL, DURABLE_IMPORTS="bench.peers.durable_side,tests.acceptance.workflows")
    lines = []
    for measure in measures:
        for mode in modes:
            if mode.key == "ttl2" and measure != "failover":
                continue  # TTL changes nothing but the failover time
            if measure == "standby" and mode is not modes[0]:
                continue  # in this process, the same for every mode
            reason = unavailable(mode)
            if reason is not None:
                result: dict[str, Any] = {"mode": mode.label, "skipped": reason}
            else:
                log_dir = Path(tempfile.mkdtemp(prefix=f"failover-{measure}-{mode.key}-"))
                try:
                    result = globals()[measure](mode, args, log_dir)
                except (AssertionError, RuntimeError) as exc:  # report it, run the rest
                    first_line = str(exc).splitlines()[0] if str(exc) else repr(exc)
                    result = {"mode": mode.label, "failed": first_line, "load": load()}
                result["logs"] = str(log_dir)
            line = f"{measure}: " + ", ".join(f"{k}={v}" for k, v in result.items())
            print(line, flush=True)
            lines.append(line)
    if args.markdown:
        args.markdown.write_text("\n".join(f"- {line}" for line in lines) + "\n")


if __name__ == "__main__":
    main()
