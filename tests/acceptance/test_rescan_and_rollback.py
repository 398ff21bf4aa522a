"""What reaches a running worker: lost notifications are a delay, rolled-back schedules nothing.

Both run on SQLite (where the rescan is the only feed) and on PostgreSQL (where these
timers' NOTIFY is deliberately never sent, and the test checks that none arrived).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test import override_settings

import durable
from durable.conf import get_settings
from durable.models import Timer
from durable.storage.notify import CHANNEL
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.acceptance.helpers import (
    RESCAN_INTERVAL_S,
    SHARDS,
    WorkerPool,
    database_url,
    fired_count,
    metric,
    owned_by,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def workers(routed_workers):
    """Every test here runs twice: workers connected directly, then through PgBouncer."""
    return routed_workers


#: Beyond the rescan interval: one worker turn plus the rescan queries of 64 shards on a
#: busy two-core machine (685 ms of lateness seen at a load average of 8).
RESCAN_SLACK_S = 0.75


@pytest.fixture
def notifications(workers: WorkerPool) -> Iterator[Any]:
    """A LISTEN session on the test database (None on SQLite) to see what was announced."""
    if connection.vendor != "postgresql":
        yield None
        return
    import psycopg

    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


def one_worker(workers: WorkerPool) -> None:
    """Start worker ``w`` and wait until it has loaded every shard's buckets."""
    worker = workers.start("w")
    workers.wait_until(
        lambda: len(owned_by("w")) == SHARDS and len(worker.events("shard.loaded")) == SHARDS,
        timeout_s=30,
        what="w holding every shard with its buckets loaded",
        require_alive=["w"],
    )


def test_timer_without_notify_fires_within_the_rescan_interval(
    workers, notifications, record_property
):
    one_worker(workers)
    count, delay = 12, timedelta(milliseconds=100)
    with override_settings(DURABLE={**settings.DURABLE, "NOTIFY": False}):
        assert get_settings().NOTIFY is False
        for i in range(count):
            with transaction.atomic():  # one commit each, after the worker loaded its buckets
                durable.schedule(probes.record, args=[f"quiet{i}"], delay=delay)
            time.sleep(0.13)  # spread the commits over the rescan cycle
    if notifications is not None:  # nothing else is scheduled meanwhile
        heard = [n.payload for n in notifications.notifies(timeout=0.2)]
        assert not heard, f"NOTIFY sent for the quiet timers: {heard}"
    # A control with NOTIFY on, for the report.
    durable.schedule(probes.record, args=["loud"], delay=delay)

    workers.wait_until(
        lambda: fired_count("quiet") == count and fired_count("loud") == 1,
        timeout_s=10,
        what="the quiet timers found by the rescan",
        require_alive=["w"],
    )
    lateness = [
        fired - due
        for fired, due in FireRecord.objects.filter(key__startswith="quiet").values_list(
            "fired_at_ms", "due_at_ms"
        )
    ]
    loud = FireRecord.objects.get(key="loud")
    metric(record_property, "rescan_found_lateness_max_ms", max(lateness))
    metric(record_property, "rescan_found_lateness_mean_ms", round(statistics.mean(lateness)))
    metric(record_property, "notify_lateness_ms", loud.fired_at_ms - loud.due_at_ms)
    assert min(lateness) >= 0, f"fired early: {lateness}"
    bound_ms = (RESCAN_INTERVAL_S + RESCAN_SLACK_S) * 1000
    assert max(lateness) <= bound_ms, (
        f"lateness {sorted(lateness)} ms exceeds the rescan interval + slack ({bound_ms} ms)\n"
        f"{workers.logs()}"
    )


class Boom(Exception):
    pass


def test_rolled_back_schedules_never_fire(workers, notifications):
    one_worker(workers)
    soon, later = timedelta(milliseconds=200), timedelta(milliseconds=900)
    # A whole transaction rolled back: single and bulk schedules.
    with pytest.raises(Boom), transaction.atomic():
        durable.schedule(probes.record, args=["ghost-single"], delay=soon, key="ghost-key")
        durable.schedule_many(
            {"fn": probes.record, "args": [f"ghost-bulk{i}"], "delay": soon} for i in range(50)
        )
        raise Boom
    # A savepoint rolled back inside a transaction that commits its neighbour.
    with transaction.atomic():
        durable.schedule(probes.record, args=["neighbour-outer"], delay=later)
        with pytest.raises(Boom), transaction.atomic():
            durable.schedule(probes.record, args=["ghost-savepoint"], delay=soon)
            raise Boom
    # Another transaction, reusing the rolled-back idempotency key: a new timer.
    with transaction.atomic():
        durable.schedule(probes.record, args=["neighbour-key"], delay=later, key="ghost-key")

    # The neighbours are due 700 ms (more than a rescan interval) after the ghosts: once
    # they fired, the ghosts would have, had anything of them been committed.
    workers.wait_until(
        lambda: fired_count("neighbour") == 2,
        timeout_s=10,
        what="the committed neighbours firing",
        require_alive=["w"],
    )
    assert fired_count("ghost") == 0, list(FireRecord.objects.values_list("key", flat=True))
    assert sorted(Timer.objects.values_list("args", flat=True)) == [
        ["neighbour-key"],
        ["neighbour-outer"],
    ]
    assert Timer.objects.get(key="ghost-key").state == "fired"
    assert fired_count("neighbour") == 2
    if notifications is not None:
        heard = [n.payload for n in notifications.notifies(timeout=0.1)]
        assert heard, "the committed neighbours were not announced"
