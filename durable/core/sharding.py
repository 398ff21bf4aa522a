"""Stable routing of keys to shards, and of fire times to storage buckets.

``shard_for`` must give the same answer on every machine and Python version forever
(changing it would orphan timers), so it uses CRC-32 of the UTF-8 key, never ``hash()``.
"""

from __future__ import annotations

import zlib
from random import getrandbits


def shard_for(routing_key: str, shards: int) -> int:
    """Return the shard in ``[0, shards)`` that owns ``routing_key``."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return zlib.crc32(routing_key.encode("utf-8")) % shards


def bucket_of(fire_at_ms: int, bucket_shift: int) -> int:
    """Return the storage bucket of an instant: ``fire_at_ms >> bucket_shift``."""
    return fire_at_ms >> bucket_shift


def bucket_start_ms(bucket: int, bucket_shift: int) -> int:
    """Return the first millisecond that falls in ``bucket``."""
    return bucket << bucket_shift


def shard_of_timer(key: str | None, shards: int) -> int:
    """Return a timer's shard: its key's shard, or a uniformly random one without a key.

    A key routes the same way on every machine (so duplicates meet on one shard); keyless
    timers are spread evenly with a random 128-bit routing key.
    """
    return shard_for(key if key is not None else f"{getrandbits(128):032x}", shards)
