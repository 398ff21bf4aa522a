"""Suite-wide test setup: PostgreSQL-only tests and the guarantee that CI really ran them.

``make test`` runs the suite twice: on SQLite, where tests marked ``postgres`` are skipped
with the reason, and on PostgreSQL with ``DURABLE_EXPECT_POSTGRES=1``. In that second run a
database that is not PostgreSQL is a usage error, and with ``DURABLE_REQUIRE_POSTGRES=1``
(CI) a run in which no PostgreSQL test passed fails.
"""

from __future__ import annotations

import os

import pytest

_POSTGRES_PASSED = 0


def _vendor() -> str:
    from django.db import connections

    return connections["default"].vendor


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    vendor = _vendor()
    if os.environ.get("DURABLE_EXPECT_POSTGRES") == "1" and vendor != "postgresql":
        raise pytest.UsageError(
            f"DURABLE_EXPECT_POSTGRES=1 but DATABASE_URL points at {vendor}, not PostgreSQL"
        )
    if vendor == "postgresql":
        return
    skip = pytest.mark.skip(reason="needs PostgreSQL; `make test` runs it against one")
    for item in items:
        if "postgres" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _POSTGRES_PASSED
    if report.when == "call" and report.passed and "postgres" in report.keywords:
        _POSTGRES_PASSED += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    required = os.environ.get("DURABLE_REQUIRE_POSTGRES") == "1"
    expected = os.environ.get("DURABLE_EXPECT_POSTGRES") == "1"
    if required and expected and exitstatus == 0 and _POSTGRES_PASSED == 0:
        print("\nDURABLE_REQUIRE_POSTGRES=1 but no PostgreSQL test passed: failing the run")
        session.exitstatus = 1
