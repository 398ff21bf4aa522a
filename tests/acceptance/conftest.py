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

from durable.testing.cluster import (
    TemporaryCluster,
    TemporaryPgBouncer,
    pgbouncer_unavailable_reason,
    unavailable_reason,
)
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


def pgbouncer_for_test_database(pool_size: int = 20) -> tuple[TemporaryPgBouncer, str, str]:
    """A started PgBouncer in front of the test database's server (skips where it cannot
    run): the bouncer, the pooled ``DATABASE_URL`` and the direct one."""
    if connection.vendor != "postgresql":
        pytest.skip("PgBouncer pools PostgreSQL connections")
    reason = pgbouncer_unavailable_reason()
    if reason is not None:
        pytest.skip(f"PgBouncer unavailable: {reason}")
    params = connection.settings_dict
    user, password = params.get("USER") or "postgres", params.get("PASSWORD") or ""
    bouncer = TemporaryPgBouncer(
        server_host=params.get("HOST") or "127.0.0.1",
        server_port=int(params.get("PORT") or 5432),
        users={user: password},
        pool_size=pool_size,
    )
    try:
        bouncer.start()
    except BaseException:
        bouncer.destroy()
        raise
    return bouncer, bouncer.url(params["NAME"], user, password), database_url(params)


@pytest.fixture(params=["direct", "pgbouncer"])
def routed_workers(
    request, transactional_db, durable_settings, tmp_path: Path
) -> Iterator[WorkerPool]:
    """Workers connected directly, then (second run) through PgBouncer in transaction mode.

    Behind PgBouncer the workers fire through the pooler and LISTEN on a direct
    connection (``DURABLE_LISTEN_DATABASE_URL``, see testproject.settings); the test
    process itself stays direct. A module opts in by defining its ``workers`` fixture as this one.
    """
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    if request.param == "direct":
        pool = WorkerPool(database_url=database_url(connection.settings_dict), log_dir=log_dir)
        try:
            yield pool
        finally:
            pool.stop_all()
        return
    bouncer, pooled, direct = pgbouncer_for_test_database()
    try:
        pool = WorkerPool(
            database_url=pooled, log_dir=log_dir, env={"DURABLE_LISTEN_DATABASE_URL": direct}
        )
        try:
            yield pool
        finally:
            pool.stop_all()
    finally:
        bouncer.destroy()


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
