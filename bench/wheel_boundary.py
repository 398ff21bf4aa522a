"""Benchmark: the longest single ``advance`` and the lateness around a level-3 boundary.

    python bench/wheel_boundary.py              # 1M timers, before and after, ~3 minutes
    python bench/wheel_boundary.py --quick      # 100,000 timers, one run: a smoke test
    python bench/wheel_boundary.py --json b.json
    python bench/wheel_boundary.py --costs      # also insert/cancel/drain, before vs after

Issue 16: crossing a level-3 boundary (every 4.66 h) used to move every loaded timer past it
in one ``advance``, and shards, whose boundaries coincide, stalled together. This runs the
wheel before the change (main at 6e4453b, read from git by ``bench/_wheel_at.py``) and
after it, in one process, on the same timers: ``--n`` timers uniform over a runner's
70-minute horizon (``HORIZON_BUCKETS`` = 64 buckets of 65.5 s), the level-3 boundary 30
minutes in.

1. **CPU, every advance.** A runner's schedule: one ``advance`` every 10 ms over the 70
   minutes. The CPU time of each call is kept, best of ``--repeat`` runs per call (so a
   spike counts only if it comes back in every run: load from other processes does not).
   Reported: the longest call, the call that crosses the boundary, the longest call at a
   level-2 boundary (every 65.5 s), the p99.9, and the most timers one call moved.
2. **Lateness in real time.** The wheels driven by the wall clock for ``--window`` seconds
   either side of the boundary, as the worker does: sleep until the earliest
   ``next_expiry`` (at most 10 ms), advance every wheel, note each timer's lateness (when
   its ``advance`` returned, minus its fire time). Once with one wheel holding all timers,
   once with ``--shards`` wheels sharing them (a worker's shards cross together). Reported:
   lateness p50/p99/max and the longest turn (all wheels advanced once), in wall-clock and
   in CPU time: on a loaded machine a gap between the two is time the process waited for a
   core, which no wheel can help.
3. **What it costs** (``--costs``): ``bench/wheel.py``'s insert, cancel, drain and memory
   figures at ``--n`` pending, with the wheel before the change in the second column.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._wheel_at import load_wheel
from durable.core.wheel import TimingWheel

BEFORE_REV = "6e4453b"  # main before issue 16's bounded advance
WheelBefore = load_wheel(BEFORE_REV).TimingWheel

START_MS = 1_700_000_000_123
MINUTE = 60_000
LEVEL3 = 1 << 24  # ms in a level-3 slot: 4.66 h
LEVEL2 = 1 << 16  # ms in a level-2 slot (and a storage bucket): 65.5 s
HORIZON = 70 * MINUTE
SIDES: dict[str, Callable[[int], Any]] = {
    "before": lambda start: WheelBefore(start_ms=start),
    "after": lambda start: TimingWheel(start_ms=start),
}


def boundary_and_start() -> tuple[int, int]:
    """A level-3 boundary, and a start 30 minutes before it."""
    boundary = (START_MS // LEVEL3 + 1) * LEVEL3
    return boundary, boundary - 30 * MINUTE


def fire_times(n: int, start: int, seed: int) -> list[int]:
    """``n`` fire times uniform over the 70-minute horizon after ``start``."""
    rnd = random.Random(seed)
    return [start + 1 + rnd.randrange(HORIZON) for _ in range(n)]


def cpu_run(side: str, times: list[int], start: int, step: int) -> tuple[list[int], list[int]]:
    """One pass in ``step`` ms: CPU ns of each advance, and timers moved by each."""
    wheel = SIDES[side](start)
    for i, t in enumerate(times):
        wheel.insert(i, t)
    clock = time.process_time_ns
    cost: list[int] = []
    moved: list[int] = []
    fired = 0
    gc.collect()
    gc.disable()
    try:
        for now in range(start + step, start + HORIZON + 1, step):
            before = wheel.cascades
            t0 = clock()
            fired += len(wheel.advance(now))
            cost.append(clock() - t0)
            moved.append(wheel.cascades - before)
    finally:
        gc.enable()
    assert fired == len(times) and len(wheel) == 0, (side, fired)
    return cost, moved


def cpu_figures(
    times: list[int], start: int, boundary: int, step: int, repeat: int
) -> dict[str, Any]:
    """Per side: the longest advance (best of ``repeat`` per call) and where it falls."""
    result: dict[str, Any] = {}
    nows = list(range(start + step, start + HORIZON + 1, step))
    crossing = next(i for i, now in enumerate(nows) if now >= boundary)
    level2 = [i for i, now in enumerate(nows) if (now - step) // LEVEL2 != now // LEVEL2]
    for side in SIDES:
        best: list[int] | None = None
        moved: list[int] = []
        for _ in range(repeat):
            cost, moved = cpu_run(side, times, start, step)
            best = cost if best is None else list(map(min, best, cost))
        assert best is not None
        worst = max(range(len(best)), key=best.__getitem__)
        ordered = sorted(best)
        result[side] = {
            "longest_ms": best[worst] / 1e6,
            "longest_at_s": (nows[worst] - boundary) / 1000,
            "crossing_ms": best[crossing] / 1e6,
            "crossing_moved": moved[crossing],
            "level2_longest_ms": max(best[i] for i in level2 if i != crossing) / 1e6,
            "p999_ms": ordered[int(len(ordered) * 0.999)] / 1e6,
            "most_moved": max(moved),
            "calls": len(best),
        }
    return result


def realtime(
    side: str, times: list[int], start: int, boundary: int, shards: int, window: int
) -> dict[str, float]:
    """Drive ``shards`` wheels by the wall clock across the boundary; lateness and turns."""
    wheels = [SIDES[side](start) for _ in range(shards)]
    fire: dict[int, int] = {}
    for i, t in enumerate(times):
        wheels[i % shards].insert(i, t)
        fire[i] = t
    for now in range(start + 1000, boundary - window * 1000, 1000):  # a runner got here
        for wheel in wheels:
            wheel.advance(now)
    first = boundary - window * 1000
    for wheel in wheels:
        wheel.advance(first)
    late: list[float] = []
    turns: list[float] = []
    turns_cpu: list[float] = []
    wall0 = time.perf_counter()

    def wheel_now() -> float:
        return first + (time.perf_counter() - wall0) * 1000

    gc.collect()
    gc.disable()
    try:
        end = float(boundary + window * 1000)
        while True:
            now = min(end, wheel_now())
            turn0, cpu0 = time.perf_counter(), time.process_time()
            for wheel in wheels:
                due = wheel.advance(int(now))
                if due:
                    done = wheel_now()
                    late += [done - fire[i] for i in due]
            turns.append((time.perf_counter() - turn0) * 1000)
            turns_cpu.append((time.process_time() - cpu0) * 1000)
            if now >= end:  # the last turn advanced every wheel to the end: stop
                break
            wake = min((w.next_expiry() or 1 << 62) for w in wheels)
            pause = min(10.0, max(0.0, wake - wheel_now()))
            if pause:
                time.sleep(pause / 1000)
    finally:
        gc.enable()
    late.sort()
    return {
        "fired": len(late),
        "late_p50_ms": late[len(late) // 2],
        "late_p99_ms": late[int(len(late) * 0.99)],
        "late_max_ms": late[-1],
        "longest_turn_ms": max(turns),
        "longest_turn_cpu_ms": max(turns_cpu),
    }


def costs(n: int, step_ms: int, repeat: int, seed: int) -> None:
    """bench/wheel.py's per-distribution table, the wheel after (left) and before (right)."""
    from bench import wheel as peers

    peers.SIDES.clear()  # its columns are "wheel" and "heap": here after and before
    peers.SIDES["wheel"] = lambda: TimingWheel(start_ms=peers.START_MS)
    peers.SIDES["heap"] = lambda: WheelBefore(start_ms=peers.START_MS)
    for key, make in (("uniform over 1 hour", peers.uniform_hour), ("mixed", peers.mixed)):
        figures = peers.run_distribution(make(n, random.Random(seed)), step_ms, repeat, seed)
        peers.print_distribution(f"{key} (columns: wheel = after, heap = BEFORE)", figures)


def main(argv: list[str] | None = None) -> None:
    """Run both parts for both sides, print the tables, optionally write JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="loaded timers (1,000,000)")
    parser.add_argument("--step-ms", type=int, default=10, help="advance period, CPU part")
    parser.add_argument("--repeat", type=int, default=3, help="CPU runs; best per call kept")
    parser.add_argument("--shards", type=int, default=64, help="wheels sharing the timers")
    parser.add_argument("--window", type=int, default=3, help="seconds each side, real time")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="100,000 timers, one run")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    parser.add_argument("--costs", action="store_true", help="insert/cancel/drain too")
    parser.add_argument("--costs-only", action="store_true", help="only insert/cancel/drain")
    args = parser.parse_args(argv)
    if args.costs_only:
        costs(100_000 if args.quick else args.n, args.step_ms, args.repeat, args.seed)
        return
    n = 100_000 if args.quick else args.n
    repeat = 1 if args.quick else args.repeat
    boundary, start = boundary_and_start()
    times = fire_times(n, start, args.seed)
    load = os.getloadavg()
    print(f"{n:,} timers over a 70-minute horizon, a level-3 boundary 30 minutes in")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    cpu = cpu_figures(times, start, boundary, args.step_ms, repeat)
    print(f"\nCPU per advance, one call every {args.step_ms} ms, best of {repeat} per call")
    print(f"  {'':34} {'before':>12} {'after':>12}")
    rows = [
        ("longest advance (ms)", "longest_ms", ".3f"),
        ("  at (s from the boundary)", "longest_at_s", ".2f"),
        ("the advance that crosses it (ms)", "crossing_ms", ".3f"),
        ("  timers it moved", "crossing_moved", ","),
        ("longest at a level-2 boundary (ms)", "level2_longest_ms", ".3f"),
        ("p99.9 of advances (ms)", "p999_ms", ".3f"),
        ("most timers moved by one call", "most_moved", ","),
    ]
    for label, key, fmt in rows:
        print(f"  {label:34} {cpu['before'][key]:>12{fmt}} {cpu['after'][key]:>12{fmt}}")
    real: dict[str, Any] = {}
    for shards in (1, args.shards):
        for side in SIDES:
            real[f"{side}_{shards}"] = realtime(side, times, start, boundary, shards, args.window)
        print(f"\nreal time, {args.window} s either side of the boundary, {shards} wheel(s)")
        print(f"  {'':34} {'before':>12} {'after':>12}")
        for label, key in (
            ("timers fired", "fired"),
            ("lateness p50 (ms)", "late_p50_ms"),
            ("lateness p99 (ms)", "late_p99_ms"),
            ("lateness max (ms)", "late_max_ms"),
            ("longest turn, wall clock (ms)", "longest_turn_ms"),
            ("longest turn, CPU (ms)", "longest_turn_cpu_ms"),
        ):
            before, after = real[f"before_{shards}"][key], real[f"after_{shards}"][key]
            print(f"  {label:34} {before:>12,.2f} {after:>12,.2f}")
    if args.costs:
        costs(n, args.step_ms, repeat, args.seed)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps({"n": n, "cpu": cpu, "real": real}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
