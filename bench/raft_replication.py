"""Benchmark: how many fires a second a Raft leader replicates (issue 17's 20,000/s).

    python bench/raft_replication.py                 # 20,000 fires/s from one leader, 20 s
    python bench/raft_replication.py 30000 20 all    # every node leads at 30,000/s

Three processes of 64 groups each (password set, loopback ``127.0.0.31``-``33``, base
port ``BENCH_RAFT_PORT`` or 27400), as :mod:`bench.raft_idle`, no worker and no database.
After the elections, the feeding node(s) hand their sidecar, every 10 ms, what a worker's
turn hands it at that rate (:meth:`durable.raft.groups.GroupSet.hand_over`, the fire
path's whole part of replication): per shard it leads, one journal with as many timers
fired (removed) as new ones entering the horizon (added), so each fire is two entries.
Each follower counts the entries it applies of the others' shards and the lag of each
batch (applied minus handed). Printed per node: fires/s handed as leader, entries/s
applied as follower, lag p50/p99/max, CPU % of a core; and the load average. It keeps up
when the followers apply what was handed (2 entries a fire) with a lag that does not grow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PORT = int(os.environ.get("BENCH_RAFT_PORT", "27400"))
NODES = [f"127.0.0.{31 + i}:{PORT}" for i in range(3)]
TURN_S = 0.01


def child(index: int, rate: int, seconds: float, feeding: bool) -> None:
    """One node: elect, then feed (if ``feeding``) and count what it applies."""
    from durable.raft import groups as groups_module
    from durable.raft.config import RaftConfig
    from durable.raft.groups import GroupSet
    from durable.raft.state import Handed, ShardState

    now_ms = lambda: time.time_ns() // 1_000_000  # noqa: E731
    applied = {"entries": 0}
    lags: list[int] = []
    inner = ShardState.apply

    def counting(self: ShardState, batch: dict) -> object:  # type: ignore[type-arg]
        result = inner(self, batch)
        if batch["owner"] != NODES[index]:
            applied["entries"] += len(batch["add"]) + len(batch["remove"])
            lags.append(now_ms() - batch["at_ms"])
        return result

    ShardState.apply = counting  # type: ignore[method-assign]
    me = NODES[index]
    config = RaftConfig(
        self_addr=me, bind=me, peers=tuple(n for n in NODES if n != me), password="bench-repl"
    )
    groups = GroupSet(config, range(64), now_ms)
    groups.start()
    time.sleep(8)  # elections, and the balancer's first round
    led = [s for s in range(64) if groups.is_leader(s)]
    next_id = {s: s * 10**9 for s in led}
    handed = 0
    before, started = os.times(), time.monotonic()
    applied["entries"], lags[:] = 0, []
    turn = started
    while time.monotonic() - started < seconds:
        if feeding and led:
            fires = int(rate * TURN_S)
            for k, shard in enumerate(led):
                n = fires // len(led) + (1 if k < fires % len(led) else 0)
                first, t = next_id[shard], now_ms()
                journal: dict[int, int | None] = {first - 60_000 + j: None for j in range(n)}
                journal.update({first + j: t + 60_000 for j in range(n)})
                next_id[shard] = first + n
                groups.hand_over(shard, Handed(me, 1, t, journal, t))
                handed += n
        turn += TURN_S
        time.sleep(max(0.0, turn - time.monotonic()))
    time.sleep(2)  # what was handed last reaches the followers
    took = time.monotonic() - started
    after = os.times()
    cpu_before, cpu_after = before.user + before.system, after.user + after.system
    lags.sort()

    def pct(p: float) -> int:
        return lags[min(len(lags) - 1, int(p * len(lags)))] if lags else -1

    print(
        json.dumps(
            {
                "node": index,
                "leads": len(led),
                "fires_handed_per_s": round(handed / seconds),
                "entries_applied_per_s": round(applied["entries"] / seconds),
                "lag_ms": [pct(0.5), pct(0.99), lags[-1] if lags else -1],
                "cpu": round(100 * (cpu_after - cpu_before) / took, 1),
                "drain_per_s": groups_module.DRAIN_PER_S,
            }
        ),
        flush=True,
    )
    time.sleep(1)
    groups.stop()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1")
        return
    rate = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    seconds = sys.argv[2] if len(sys.argv) > 2 else "20"
    everyone = len(sys.argv) > 3 and sys.argv[3] == "all"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "child",
                str(i),
                str(rate),
                seconds,
                "1" if everyone or i == 0 else "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(3)
    ]
    for p in procs:
        print(p.communicate()[0].strip().splitlines()[-1])
    feeding = "all" if everyone else "node 0"
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"rate={rate} fires/s per feeding leader, feeding={feeding}, load={load}")


if __name__ == "__main__":
    main()
