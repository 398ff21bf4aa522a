"""Benchmark: durable's TimingWheel against heapq with lazy cancellation, side by side.

    python bench/wheel.py                      # full run: 1M pending, curve up to 4M
    python bench/wheel.py --quick              # small sizes, a smoke test (seconds)
    python bench/wheel.py --json wheel.json    # also write every figure for plot_wheel.py

The peer is the standard Python answer, the one asyncio's event loop uses: a heap of
``(fire_at, seq, id)`` tuples, cancel flags the entry as dead (here: drops it from a dict of
live entries), and the heap is rebuilt when more than half of it is dead. Both sides get the
same ids, the same fire times in the same insertion order and the same advance schedule, and
both must return exactly the same ids in the same order (checked on every drain).

The advance schedule is what a shard runner does: wake at the next fire time, but no more
often than every ``--step-ms`` (10 ms), and fire everything due. Computed once from the fire
times and handed to both sides, so neither side's ``next_expiry`` shapes the other's work.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import json
import platform
import random
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from durable.core.wheel import TimingWheel

K = TypeVar("K", bound=Hashable)

START_MS = 1_700_000_000_123  # a real epoch instant, deliberately not slot-aligned
MINUTE, HOUR, DAY = 60_000, 3_600_000, 86_400_000


class Timers(Protocol):
    """What both contenders offer."""

    def insert(self, timer_id: int, fire_at_ms: int) -> int: ...
    def cancel(self, handle: int) -> bool: ...
    def advance(self, now_ms: int) -> list[int]: ...
    def __len__(self) -> int: ...


class HeapTimers(Generic[K]):
    """heapq timers with lazy cancellation and compaction, as asyncio's event loop does."""

    __slots__ = ("_cancelled", "_heap", "_live", "_seq", "_time_ms")

    def __init__(self, start_ms: int = 0) -> None:
        self._heap: list[tuple[int, int, K]] = []
        self._live: dict[K, int] = {}  # pending id -> seq of its live heap entry
        self._seq = itertools.count()  # ties fire in insertion order, like the wheel
        self._cancelled = 0
        self._time_ms = start_ms

    def __len__(self) -> int:
        return len(self._live)

    def insert(self, timer_id: K, fire_at_ms: int) -> K:
        live = self._live
        if timer_id in live:
            raise ValueError(f"timer {timer_id!r} is already pending")
        seq = next(self._seq)
        heapq.heappush(self._heap, (fire_at_ms, seq, timer_id))
        live[timer_id] = seq
        return timer_id

    def cancel(self, handle: K) -> bool:
        if self._live.pop(handle, None) is None:
            return False
        self._cancelled += 1
        return True

    def advance(self, now_ms: int) -> list[K]:
        heap, live = self._heap, self._live
        # asyncio's rule (base_events._run_once): rebuild when > 100 entries, > half dead.
        if len(heap) > 100 and self._cancelled * 2 > len(heap):
            heap = self._heap = [e for e in heap if live.get(e[2]) == e[1]]
            heapq.heapify(heap)
            self._cancelled = 0
        self._time_ms = now = max(self._time_ms, now_ms)
        out: list[K] = []
        pop = heapq.heappop
        while heap and heap[0][0] <= now:
            _, seq, timer_id = pop(heap)
            if live.get(timer_id) == seq:
                del live[timer_id]
                out.append(timer_id)
            else:
                self._cancelled -= 1
        return out


SIDES: dict[str, Callable[[], Timers]] = {
    "wheel": lambda: TimingWheel(start_ms=START_MS),
    "heap": lambda: HeapTimers(start_ms=START_MS),
}


# -- workloads -------------------------------------------------------------------------------


def uniform_hour(n: int, rnd: random.Random) -> list[int]:
    """Fire times uniform over the next hour (a runner's horizon is about 70 minutes)."""
    return [START_MS + 1 + rnd.randrange(HOUR) for _ in range(n)]


def mixed(n: int, rnd: random.Random) -> list[int]:
    """50% within a minute, 30% from a minute to a day, 20% from a day to 30 days."""
    bands = [(1, MINUTE)] * 5 + [(MINUTE, DAY)] * 3 + [(DAY, 30 * DAY)] * 2
    return [START_MS + rnd.randrange(*rnd.choice(bands)) for _ in range(n)]


def fixed_rate(n: int, rnd: random.Random) -> list[int]:
    """One timer per ms on average: n pending span n ms, so only the pending count grows."""
    return [START_MS + 1 + rnd.randrange(n) for _ in range(n)]


def schedule(fire_times: Sequence[int], step_ms: int) -> list[int]:
    """Wake at the next fire time, but at most once per ``step_ms``; end when all fired."""
    steps: list[int] = []
    now = START_MS
    for t in sorted(fire_times):
        if t > now:
            now = max(t, now + step_ms)
            steps.append(now)
    return steps


# -- measurements ----------------------------------------------------------------------------


def exhaust(iterator: Iterable[object]) -> None:
    """Run an iterator to its end at C speed, so loop overhead is the same on both sides."""
    deque(iterator, maxlen=0)


def cpu_seconds(fn: Callable[[], object]) -> float:
    """CPU seconds spent in ``fn``: the machine is shared, so wall time would count others.

    The cyclic GC is off while timing, as ``timeit`` does: neither side creates cycles, and
    its passes over whatever else happens to be alive would be noise, not either side's cost.
    """
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    finally:
        gc.enable()


def filled(side: str, ids: list[int], times: list[int]) -> Timers:
    """A fresh structure of ``side`` holding every timer."""
    timers = SIDES[side]()
    exhaust(map(timers.insert, ids, times))
    return timers


def insert_rate(side: str, ids: list[int], times: list[int]) -> float:
    """Inserts per second into an empty structure."""
    timers = SIDES[side]()
    return len(ids) / cpu_seconds(lambda: exhaust(map(timers.insert, ids, times)))


def cancel_rate(side: str, ids: list[int], times: list[int], order: list[int]) -> float:
    """Cancels per second of every timer in ``order``, plus one advance for deferred work."""
    timers = filled(side, ids, times)

    def run() -> None:
        exhaust(map(timers.cancel, order))
        timers.advance(START_MS)  # the heap compacts here, as asyncio's loop does

    rate = len(ids) / cpu_seconds(run)
    assert len(timers) == 0
    return rate


def drain(
    side: str, ids: list[int], times: list[int], steps: list[int]
) -> tuple[float, list[int], Timers]:
    """Fired timers per second over the schedule, the ids in fired order, the structure."""
    timers = filled(side, ids, times)
    batches: list[list[int]] = []
    rate = len(ids) / cpu_seconds(lambda: batches.extend(map(timers.advance, steps)))
    fired = list(itertools.chain.from_iterable(batches))
    assert len(fired) == len(ids) and len(timers) == 0, (side, len(fired))
    return rate, fired, timers


def floor_ns(ids: list[int], times: list[int]) -> float:
    """CPU ns per timer to delete every id from a dict, in fire order.

    Any structure that keeps pending ids in a dict (both sides here) pays at least this
    while draining: it is what memory latency alone costs at this size.
    """
    table = dict(zip(ids, times, strict=True))
    order = sorted(ids, key=times.__getitem__)
    return cpu_seconds(lambda: exhaust(map(table.__delitem__, order))) / len(ids) * 1e9


def traced_bytes(build: Callable[..., object], *args: Any) -> int:
    """Bytes allocated and still held by what ``build(*args)`` returns (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build(*args)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del kept
    return used


def bare_heap(ids: list[int], times: list[int]) -> list[tuple[int, int]]:
    """A plain heap of ``(fire_at, id)`` tuples, no cancel support: the memory yardstick."""
    heap: list[tuple[int, int]] = []
    for t, i in zip(times, ids, strict=True):
        heapq.heappush(heap, (t, i))
    return heap


def idle_seconds(side: str) -> float:
    """CPU seconds for one advance across 30 idle days, one timer due right after them."""
    timers = SIDES[side]()
    end = START_MS + 30 * DAY
    timers.insert(0, end + 1)
    t0 = time.process_time()
    due = timers.advance(end)
    elapsed = time.process_time() - t0
    assert due == [] and timers.advance(end + 1) == [0]
    return elapsed


def best_of(
    repeat: int, measure: Callable[[str], float], lower_is_better: bool = False
) -> dict[str, float]:
    """Best of ``repeat`` runs per side, sides alternating so drifting load hits both."""
    runs: dict[str, list[float]] = {side: [] for side in SIDES}
    for _ in range(repeat):
        for side in SIDES:
            runs[side].append(measure(side))
    pick = min if lower_is_better else max
    return {side: pick(values) for side, values in runs.items()}


def drain_rates(
    ids: list[int], times: list[int], steps: list[int], repeat: int
) -> tuple[dict[str, float], TimingWheel[int]]:
    """Best drain rate per side, and a drained wheel (for its counters).

    The first run of each side must fire exactly the same ids in the same order.
    """
    first: dict[str, list[int]] = {}
    wheels: list[TimingWheel[int]] = []

    def measure(side: str) -> float:
        rate, fired, timers = drain(side, ids, times, steps)
        first.setdefault(side, fired)
        if isinstance(timers, TimingWheel):
            wheels[:] = [timers]
        return rate

    rates = best_of(repeat, measure)
    assert first["wheel"] == first["heap"], "the two sides fired different ids or orders"
    return rates, wheels[0]


def run_distribution(times: list[int], step_ms: int, repeat: int, seed: int) -> dict[str, Any]:
    """Every per-distribution figure for both sides."""
    ids = list(range(len(times)))
    steps = schedule(times, step_ms)
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    return {
        "n": len(ids),
        "advance_calls": len(steps),
        "insert_per_s": best_of(repeat, lambda side: insert_rate(side, ids, times)),
        "cancel_per_s": best_of(repeat, lambda side: cancel_rate(side, ids, times, shuffled)),
        "cancel_in_order_per_s": best_of(repeat, lambda side: cancel_rate(side, ids, times, ids)),
        "drain_per_s": drain_rates(ids, times, steps, repeat)[0],
        "bytes_per_timer": {
            **{side: traced_bytes(filled, side, ids, times) / len(ids) for side in SIDES},
            "bare_heap": traced_bytes(bare_heap, ids, times) / len(ids),
        },
    }


def run_curve(sizes: list[int], step_ms: int, repeat: int, seed: int) -> dict[str, Any]:
    """Drain cost per fired timer as the pending count grows at a fixed firing rate."""
    keys = ("wheel_ns", "heap_ns", "floor_ns", "wheel_moves", "wheel_visits")
    curve: dict[str, Any] = {"sizes": sizes, **{key: [] for key in keys}}
    for n in sizes:
        ids, times = list(range(n)), fixed_rate(n, random.Random(seed))
        rates, wheel = drain_rates(ids, times, schedule(times, step_ms), repeat)
        curve["wheel_ns"].append(1e9 / rates["wheel"])
        curve["heap_ns"].append(1e9 / rates["heap"])
        curve["floor_ns"].append(min(floor_ns(ids, times) for _ in range(repeat)))
        curve["wheel_moves"].append(wheel.cascades / n)
        curve["wheel_visits"].append(wheel.slot_visits / n)
    return curve


def print_curve(curve: dict[str, Any]) -> None:
    """The curve's table, with the wheel's work per timer and the memory floor."""
    print("\ndrain: CPU per fired timer vs pending count (1 timer per ms: n pending span n ms)")
    print(
        f"  {'pending':>10} {'wheel ns':>9} {'heap ns':>9} {'wheel/heap':>10}"
        f"  {'wheel moves':>11} {'slot visits':>11} {'floor ns':>9}"
    )
    for i, size in enumerate(curve["sizes"]):
        wheel, heap = curve["wheel_ns"][i], curve["heap_ns"][i]
        print(
            f"  {size:>10,} {wheel:>9,.0f} {heap:>9,.0f} {wheel / heap:>9.2f}x"
            f"  {curve['wheel_moves'][i]:>11.2f} {curve['wheel_visits'][i]:>11.2f}"
            f" {curve['floor_ns'][i]:>9,.0f}"
        )
    print("  (moves and slot visits are per fired timer; floor: deleting each id from a dict")
    print("   in fire order, the memory latency any dict-based structure pays at that size)")


def run_low_load(repeat: int, seed: int, n: int = 20_000) -> dict[str, Any]:
    """Drain at low load: few timers, one per wake-up, where per-call overhead dominates."""
    times = uniform_hour(n, random.Random(seed))
    steps = schedule(times, 10)
    rates, _ = drain_rates(list(range(n)), times, steps, repeat)
    print_rows(
        f"low load: {n:,} pending over 1 hour, {len(steps):,} advance calls",
        [("drain: CPU per fired timer", 1e9 / rates["wheel"], 1e9 / rates["heap"], "ns")],
    )
    return {"n": n, "advance_calls": len(steps), "drain_per_s": rates}


def boundary_advance(side: str, n: int, seed: int) -> tuple[float, float, int]:
    """Advance through 70 minutes in 10 ms steps that cross a 4.66 h (level-3) boundary.

    ``n`` timers uniform over the 70 minutes, a worker's horizon; the boundary falls 30
    minutes in. Returns the CPU seconds of the call that crosses the boundary, of the
    slowest call, and how many timers the crossing moved down a level (wheel only).
    """
    level3 = 1 << 24
    start = (START_MS // level3 + 1) * level3 - 30 * MINUTE
    timers: Timers = TimingWheel(start_ms=start) if side == "wheel" else HeapTimers(start)
    rnd = random.Random(seed)
    fire_times = [start + 1 + rnd.randrange(70 * MINUTE) for _ in range(n)]
    exhaust(map(timers.insert, range(n), fire_times))
    crossing, worst, moved, clock = 0.0, 0.0, 0, time.process_time
    gc.disable()
    for now in range(start + 10, start + 70 * MINUTE + 1, 10):
        before = getattr(timers, "cascades", 0)
        t0 = clock()
        timers.advance(now)
        elapsed = clock() - t0
        worst = max(worst, elapsed)
        if now - 10 < start + 30 * MINUTE <= now:
            crossing, moved = elapsed, getattr(timers, "cascades", 0) - before
    gc.enable()
    assert len(timers) == 0
    return crossing, worst, moved


def run_spike(n: int, seed: int) -> dict[str, Any]:
    """The advance at which a worker's 70-minute horizon crosses a level-3 boundary."""
    got = {side: boundary_advance(side, n, seed) for side in SIDES}
    wheel, heap = got["wheel"], got["heap"]
    print_rows(
        f"a 70-minute horizon of {n:,} timers crossing a 4.66 h boundary, 10 ms steps",
        [
            ("the advance that crosses it", wheel[0] * 1e6, heap[0] * 1e6, "us"),
            ("the slowest advance", wheel[1] * 1e6, heap[1] * 1e6, "us"),
        ],
    )
    print(f"  (crossing it, the wheel moved {wheel[2]:,} timers down a level at once)")
    return {s: {"crossing_s": c, "worst_s": w, "moved": m} for s, (c, w, m) in got.items()}


def run_idle(repeat: int) -> dict[str, float]:
    """One advance across 30 idle days, printed."""
    alone = best_of(repeat * 3, idle_seconds, lower_is_better=True)
    print_rows(
        "one advance across 30 idle days, one timer due right after",
        [("CPU of the call", alone["wheel"] * 1e6, alone["heap"] * 1e6, "us")],
    )
    return alone


# -- report ----------------------------------------------------------------------------------


def print_rows(title: str, rows: list[tuple[str, float, float, str]]) -> None:
    """One table: label, wheel, heap, their ratio, unit."""
    print(f"\n{title}")
    print(f"  {'':36} {'wheel':>12} {'heap':>12} {'wheel/heap':>10}")
    for label, wheel, heap, unit in rows:
        print(f"  {label:36} {wheel:>12,.0f} {heap:>12,.0f} {wheel / heap:>9.2f}x  {unit}")


def print_distribution(title: str, fig: dict[str, Any]) -> None:
    """The table of one distribution."""

    def pair(key: str) -> tuple[float, float]:
        return fig[key]["wheel"], fig[key]["heap"]

    drain_w, drain_h = pair("drain_per_s")
    b = fig["bytes_per_timer"]
    print_rows(
        f"{title}: {fig['n']:,} pending, {fig['advance_calls']:,} advance calls",
        [
            ("insert", *pair("insert_per_s"), "timers/s"),
            ("cancel, random order", *pair("cancel_per_s"), "timers/s"),
            ("cancel, insertion order", *pair("cancel_in_order_per_s"), "timers/s"),
            ("drain: fire all on the schedule", drain_w, drain_h, "timers/s"),
            ("drain: CPU per fired timer", 1e9 / drain_w, 1e9 / drain_h, "ns"),
            ("memory per pending timer", b["wheel"], b["heap"], "bytes"),
            ("  vs plain heap of (fire_at, id)", b["wheel"], b["bare_heap"], "bytes"),
        ],
    )


def verdicts(result: dict[str, Any]) -> list[tuple[bool, str]]:
    """The targets of the wheel's issue, each checked against this run's figures."""
    out = []
    for key in ("uniform_1h", "mixed"):
        fig = result[key]
        drain_x = fig["drain_per_s"]["wheel"] / fig["drain_per_s"]["heap"]
        out.append((drain_x >= 2, f"{key}: drain {drain_x:.2f}x heapq (target >= 2x)"))
        for op in ("insert", "cancel"):
            rate = fig[f"{op}_per_s"]["wheel"]
            out.append((rate >= 1e6, f"{key}: {op} {rate / 1e6:.2f}M/s (target >= 1M/s)"))
        mem_x = fig["bytes_per_timer"]["wheel"] / fig["bytes_per_timer"]["bare_heap"]
        out.append((mem_x <= 2.5, f"{key}: memory {mem_x:.2f}x (fire_at, id) heap (<= 2.5x)"))
    idle_ms = result["idle_30d"]["wheel"] * 1e3
    out.append((idle_ms <= 1, f"30 idle days: {idle_ms:.3f} ms (target <= 1 ms)"))
    curve = result["curve"]
    wheel_growth = max(curve["wheel_ns"]) / min(curve["wheel_ns"])
    heap_growth = curve["heap_ns"][-1] / curve["heap_ns"][0]
    out.append(
        (
            wheel_growth <= 1.5 and heap_growth > wheel_growth,
            f"curve {curve['sizes'][0]:,}..{curve['sizes'][-1]:,}: wheel max/min"
            f" {wheel_growth:.2f} (flat: <= 1.5), heap last/first {heap_growth:.2f}",
        )
    )
    return out


def main(argv: list[str] | None = None) -> None:
    """Run everything, print the tables and the verdicts, optionally write JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="pending timers (1,000,000)")
    parser.add_argument("--curve", default="10000,100000,1000000,4000000", help="curve sizes")
    parser.add_argument("--step-ms", type=int, default=10, help="min gap between advances")
    parser.add_argument("--repeat", type=int, default=3, help="runs per figure, best kept")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small sizes, one run: a smoke test")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    n = 20_000 if args.quick else args.n
    repeat = 1 if args.quick else args.repeat
    sizes = [1_000, 10_000, 40_000] if args.quick else [int(x) for x in args.curve.split(",")]
    print(
        f"TimingWheel vs heapq with lazy cancel; Python {platform.python_version()}, "
        f"{platform.machine()}; CPU time, best of {repeat}"
    )
    print(f"advance schedule: each next fire time, at most one advance per {args.step_ms} ms")
    result: dict[str, Any] = {
        "python": platform.python_version(),
        "step_ms": args.step_ms,
        "repeat": repeat,
        "quick": args.quick,
    }
    for key, make, title in (
        ("uniform_1h", uniform_hour, "uniform over 1 hour"),
        ("mixed", mixed, "mixed: 50% < 1 min, 30% < 1 day, 20% < 30 days"),
    ):
        times = make(n, random.Random(args.seed))
        result[key] = run_distribution(times, args.step_ms, repeat, args.seed)
        print_distribution(title, result[key])
    result["low_load"] = run_low_load(repeat, args.seed)
    result["idle_30d"] = run_idle(repeat)
    result["spike"] = run_spike(n // 10, args.seed)
    result["curve"] = run_curve(sizes, args.step_ms, repeat, args.seed)
    print_curve(result["curve"])
    print("\ntargets" + (" (set for the full run: --quick only smoke-tests)" if args.quick else ""))
    for ok, text in verdicts(result):
        print(f"  {'met ' if ok else 'MISS'}  {text}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
