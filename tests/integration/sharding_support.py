"""Keys that land in chosen shards, for tests that need timers in given shards."""

from __future__ import annotations

from durable.core.sharding import shard_of_timer


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
