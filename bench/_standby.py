"""``bench/failover.py --only standby``: a follower's standby against the owner's wheel.

Issue 17's target: a standby's memory at most the owner's wheel memory + 20 %. Both are
built here from the same ``timers`` ids and fire times (up to 60 min out), the standby
through real replicated batches (:func:`durable.raft.state.make_batch`); tracemalloc
counts what each keeps, ids included (made inside each build, as the rows' decoding and
pysyncobj's unpickling make them in a worker).
"""

from __future__ import annotations

from typing import Any

from bench._common import wall_ms


def standby_against_wheel(timers: int) -> dict[str, Any]:
    """Bytes (tracemalloc) of ``timers`` timers in an owner's wheel and in a follower's
    standby (the replicated state, fed through real batches), in this process."""
    import gc
    import random
    import tracemalloc

    from durable.core.wheel import TimingWheel
    from durable.raft.state import MAX_COMMAND_ENTRIES, ShardState, make_batch

    now, rng = int(wall_ms()), random.Random(17)
    fire = [now + rng.randrange(1, 3_600_000) for _ in range(timers)]

    def traced(build: Any) -> float:
        gc.collect()
        tracemalloc.start()
        kept = build()  # ids made in here, as the rows' decoding or unpickling makes them
        gc.collect()
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del kept
        return size / 1e6

    def owner() -> Any:
        wheel: TimingWheel[int] = TimingWheel(start_ms=now)
        for i, at in enumerate(fire):
            wheel.insert(10**9 + i, at)
        return wheel

    def follower() -> Any:
        state = ShardState()
        for lo in range(0, timers, MAX_COMMAND_ENTRIES):
            added = [(10**9 + i, fire[i]) for i in range(lo, min(timers, lo + MAX_COMMAND_ENTRIES))]
            state.apply(make_batch(owner="n1", token=1, term=1, cursor_ms=now, added=added))
        return state

    wheel_mb, standby_mb = traced(owner), traced(follower)
    return {
        "timers": timers,
        "owner_wheel_mb": round(wheel_mb, 1),
        "standby_mb": round(standby_mb, 1),
        "standby_over_wheel": round(standby_mb / wheel_mb, 2),
        "target": "<= 1.2",
    }
