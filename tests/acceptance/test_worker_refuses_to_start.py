"""A real ``manage.py run_timer_shards`` process refuses to start on bad settings or
orphaned shards, listing every problem, and starts once they are fixed."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.test import override_settings

import durable
from durable.core.sharding import shard_for
from testproject.demo import handlers as h
from tests.acceptance.helpers import (
    BATCH_TIME_BUDGET_S,
    LEASE_TTL_S,
    REPO_ROOT,
    RESCAN_INTERVAL_S,
    database_url,
)

# Far enough ahead that the worker started at the end does not fire them.
LATER = timedelta(hours=1)


def _manage(*args: str, database_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": database_url,
        "DURABLE_LEASE_TTL_S": str(LEASE_TTL_S),
        "DURABLE_RESCAN_INTERVAL_S": str(RESCAN_INTERVAL_S),
        "DURABLE_BATCH_TIME_BUDGET_S": str(BATCH_TIME_BUDGET_S),
        "DURABLE_LOG_LEVEL": "INFO",
        **env,
    }
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_bad_settings_stop_the_worker_with_every_problem(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'unused.sqlite3'}"
    done = _manage(
        "run_timer_shards",
        "--duration",
        "5",
        database_url=url,
        DURABLE_LEASE_TTL_S="-1",
        DURABLE_RESCAN_INTERVAL_S="0",
        DURABLE_DISPATCH="celery",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SystemCheckError" in done.stderr
    for expected in ("LEASE_TTL_S", "RESCAN_INTERVAL_S", "durable.E003", "durable.E004"):
        assert expected in done.stderr, done.stderr
    assert "worker.started" not in done.stdout + done.stderr


def test_check_on_an_unmigrated_database_has_nothing_to_say(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'empty.sqlite3'}"
    done = _manage("check", "--database", "default", database_url=url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no issues" in done.stdout and "durable" not in done.stderr


def test_check_on_an_unreachable_database_warns_it_could_not_look():
    url = "postgres://durable:durable@127.0.0.1:1/nowhere"  # nothing listens on port 1
    done = _manage("check", "--database", "default", database_url=url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "durable.W002" in done.stderr and "127.0.0.1" in done.stderr


@pytest.mark.django_db(transaction=True)
def test_orphaned_shards_stop_the_worker_until_shards_is_raised_back():
    keys = [f"order-{i}" for i in range(2_000) if shard_for(f"order-{i}", 128) >= 64][:3]
    with override_settings(DURABLE={"SHARDS": 128}):
        timers = [durable.schedule(h.noop, key=key, delay=LATER) for key in keys]
    shards = sorted({t.shard for t in timers})
    url = database_url(connection.settings_dict)

    refused = _manage("run_timer_shards", "--duration", "5", database_url=url, DURABLE_SHARDS="64")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "durable.E006" in refused.stderr
    for shard in shards:
        assert f"shard {shard}: " in refused.stderr
    assert "back to" in refused.stderr

    started = _manage("run_timer_shards", "--duration", "1", database_url=url, DURABLE_SHARDS="128")
    assert started.returncode == 0, started.stdout + started.stderr
    assert "worker.started" in started.stdout + started.stderr
