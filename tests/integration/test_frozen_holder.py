"""A new Raft leader ends the transaction of a frozen old owner that holds the shard's
lease row (``durable.storage.leases.end_frozen_holders``), instead of waiting for
PostgreSQL's idle-in-transaction timeout (twice ``LEASE_TTL_S``)."""

from __future__ import annotations

import time

import psycopg
import pytest
from django.db import connections

from durable.storage import leases

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _holder(shard: int) -> psycopg.Connection:
    """Another session that locks ``shard``'s lease row and then sits idle in its
    transaction, as a worker frozen inside a firing batch does."""
    settings = connections["default"].settings_dict
    conn = psycopg.connect(
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        dbname=settings["NAME"],
    )
    conn.execute("SELECT 1 FROM durable_shardlease WHERE shard = %s FOR UPDATE", [shard])
    return conn


def _alive(conn: psycopg.Connection) -> bool:
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


def test_only_a_session_idle_past_the_limit_on_the_named_rows_is_ended():
    leases.ensure_shards("default", 8)
    frozen, other = _holder(3), _holder(5)
    try:
        frozen_pid = frozen.info.backend_pid
        assert leases.end_frozen_holders("default", [3], idle_s=30) == []  # not idle long
        time.sleep(0.3)
        assert leases.end_frozen_holders("default", [3], idle_s=0.2) == [frozen_pid]
        assert not _alive(frozen)
        assert _alive(other)  # holds shard 5, which was not named
        other.rollback()
    finally:
        frozen.close()
        other.close()


def test_a_lock_that_was_released_is_not_followed():
    leases.ensure_shards("default", 8)
    conn = _holder(2)
    try:
        conn.rollback()  # the row keeps its xmax, but nobody holds that transaction
        time.sleep(0.3)
        assert leases.end_frozen_holders("default", [2], idle_s=0.1) == []
        assert _alive(conn)
    finally:
        conn.close()
