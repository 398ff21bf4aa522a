"""Benchmark: idle CPU of the Raft groups alone, three processes of 64 groups each (issue 17).

    python bench/raft_idle.py                          # the default tuning, 15 s
    python bench/raft_idle.py '{"heartbeat_s": 0.1}'   # RaftConfig fields as JSON
    python bench/raft_idle.py '{}' 30

No worker and no database: each process runs one :class:`durable.raft.groups.GroupSet`
(password set, loopback ``127.0.0.21``-``23``, base port ``BENCH_RAFT_PORT`` or 27300),
waits 6 s for the elections, then measures its own CPU. It isolates the sidecar's cost
from the worker's (``bench/failover.py --only idle`` measures whole nodes). Prints each
process's CPU in % of a core, their sum, the groups each leads, and the load average.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PORT = int(os.environ.get("BENCH_RAFT_PORT", "27300"))
NODES = [f"127.0.0.{21 + i}:{PORT}" for i in range(3)]


def child(index: int, tuning: dict[str, float], seconds: float) -> None:
    """One node: start its groups, settle, print its CPU over ``seconds`` as JSON."""
    from durable.raft.config import RaftConfig
    from durable.raft.groups import GroupSet

    me = NODES[index]
    config = RaftConfig(
        self_addr=me,
        bind=me,
        peers=tuple(n for n in NODES if n != me),
        password="bench-raft-idle",
        **tuning,  # type: ignore[arg-type]
    )
    groups = GroupSet(config, range(64), lambda: time.time_ns() // 1_000_000)
    groups.start()
    time.sleep(6)
    before, started = os.times(), time.monotonic()
    time.sleep(seconds)
    after, took = os.times(), time.monotonic() - started
    cpu = 100 * (after.user + after.system - before.user - before.system) / took
    leads = sum(groups.is_leader(s) for s in range(64))
    print(json.dumps({"cpu": round(cpu, 1), "leads": leads}), flush=True)
    time.sleep(1)  # the others finish measuring before this node's groups go
    groups.stop()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(int(sys.argv[2]), json.loads(sys.argv[3]), float(sys.argv[4]))
        return
    tuning = sys.argv[1] if len(sys.argv) > 1 else "{}"
    seconds = sys.argv[2] if len(sys.argv) > 2 else "15"
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "child", str(i), tuning, seconds],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(3)
    ]
    out = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    cpus = [o["cpu"] for o in out]
    print(
        f"tuning={tuning} cpu_percent_of_a_core={cpus} sum={round(sum(cpus), 1)}"
        f" leads={[o['leads'] for o in out]} load={Path('/proc/loadavg').read_text().split()[0]}"
    )


if __name__ == "__main__":
    main()
