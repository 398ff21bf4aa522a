"""Routing of timers to shards and buckets (durable.core.sharding)."""

from collections import Counter

from durable.core.sharding import bucket_of, bucket_start_ms, shard_for, shard_of_timer


def test_a_key_routes_to_the_same_shard_every_time():
    assert shard_of_timer("reminder:42", 64) == shard_for("reminder:42", 64)
    assert len({shard_of_timer("reminder:42", 64) for _ in range(50)}) == 1


def test_keyless_timers_spread_over_every_shard():
    counts = Counter(shard_of_timer(None, 8) for _ in range(4_000))
    assert set(counts) == set(range(8))
    assert min(counts.values()) > 300  # 500 expected per shard


def test_buckets_cover_their_range():
    assert bucket_of(bucket_start_ms(7, 16), 16) == 7
    assert bucket_of(bucket_start_ms(8, 16) - 1, 16) == 7
