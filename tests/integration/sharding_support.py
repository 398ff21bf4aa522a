"""Keys that land in chosen shards, and timers made due under them, for engine tests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import durable
from durable.core.sharding import shard_of_timer
from testproject.demo import probes


def keys_in_shards(prefix: str, shards: int, per_shard: int, total: int) -> dict[int, list[str]]:
    """``per_shard`` keys ``prefix-<n>`` for each of shards ``0 .. shards - 1`` (of ``total``)."""
    found: dict[int, list[str]] = {s: [] for s in range(shards)}
    i = 0
    while any(len(keys) < per_shard for keys in found.values()):
        key = f"{prefix}-{i}"
        keys = found.get(shard_of_timer(key, total))
        if keys is not None and len(keys) < per_shard:
            keys.append(key)
        i += 1
    return found


def make_due(engine: Any, clock: Any, keys: list[str]) -> int:
    """Schedule a ``probes.record`` timer per key 1 s out, load it, and move the manual
    clock past it; return the new now (ms)."""
    for key in keys:
        durable.schedule(probes.record, args=[key], key=key, delay=timedelta(seconds=1))
    now = clock.now_ms()
    for runner in engine.runners.values():
        runner.rescan(now)
    clock.advance(1_000)
    return int(clock.now_ms())
