"""Fixtures for acceptance tests: worker subprocesses on the test database, throwaway clusters.

Every test here runs with ``django_db(transaction=True)`` so what it schedules is
committed and visible to the workers. The ``workers`` fixture depends on
``transactional_db``, so its finalizer (which stops every worker) runs before
pytest-django flushes the database.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from durable.testing.cluster import TemporaryCluster, unavailable_reason
from tests.acceptance.helpers import (
    BATCH_TIME_BUDGET_S,
    LEASE_TTL_S,
    RESCAN_INTERVAL_S,
    SHARDS,
    WorkerPool,
    database_url,
)


@pytest.fixture
def durable_settings(settings):
    """The test process schedules with the same shard count and timings as the workers."""
    settings.DURABLE = {
        **settings.DURABLE,
        "SHARDS": SHARDS,
        "LEASE_TTL_S": LEASE_TTL_S,
        "RESCAN_INTERVAL_S": RESCAN_INTERVAL_S,
        "BATCH_TIME_BUDGET_S": BATCH_TIME_BUDGET_S,
    }
    return settings


@pytest.fixture
def workers(transactional_db, durable_settings, tmp_path: Path) -> Iterator[WorkerPool]:
    """A pool of ``run_timer_shards`` subprocesses on the test database, stopped at the end."""
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    pool = WorkerPool(database_url=database_url(connection.settings_dict), log_dir=log_dir)
    try:
        yield pool
    finally:
        pool.stop_all()


@pytest.fixture
def pg_cluster() -> Iterator[TemporaryCluster]:
    """A private PostgreSQL server (initdb in a temp dir), always stopped and deleted."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"throwaway PostgreSQL cluster unavailable: {reason}")
    cluster = TemporaryCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()
