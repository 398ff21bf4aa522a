"""An external timer whose completion meets a dropped database session still completes.

Found by the chaos run (``make chaos``, seed 20261201): the nemesis terminated a worker's
sessions (``pg_terminate_backend``) while external handlers ran; the handler thread's
completion failed with "the connection is lost", was only logged, and the timer stayed
``firing`` under its live owner's claim until a takeover or ``CLAIM_TIMEOUT_S`` (300 s)
later (77 s late in that run). The completion is now retried on a new connection, with
backoff, until it commits or the claim's ``CLAIM_TIMEOUT_S`` has passed (a PostgreSQL
restart of a few seconds, ``--pg-restart``, outlasted a first version that gave up
after 1.5 s).
"""

from __future__ import annotations

import threading

import pytest
from django.db import connection

import durable
from durable.models import Timer
from testproject.demo import chaos
from testproject.demo.models import FireRecord
from tests.integration.polling import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def engine(start_engine):
    return start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0})


def test_a_completion_on_a_dropped_session_is_retried_not_left_firing(engine, clock):
    timer = durable.schedule(chaos.drop_own_session, args=["dropped"])
    clock.advance(1_000)
    engine.tick()
    assert wait_for(lambda: Timer.objects.get(pk=timer.pk).state != "firing"), (
        "the timer was left firing after its completion met a dropped session"
    )
    row = Timer.objects.get(pk=timer.pk)
    assert (row.state, row.attempts) == ("fired", 1)
    assert list(FireRecord.objects.values_list("key", flat=True)) == ["dropped"]
    assert engine.firer.in_flight == 0


def test_a_completion_waits_out_a_database_that_refuses_connections_for_seconds(engine, clock):
    """The handler's session is dropped and no new one is accepted for 3 s (as during a
    PostgreSQL restart): the completion keeps retrying and commits once it can."""
    import psycopg

    name = connection.settings_dict["NAME"]
    # Opened before the handler sets the limit: the session that lifts it again.
    admin = psycopg.connect(
        dbname=name,
        user=connection.settings_dict["USER"],
        password=connection.settings_dict["PASSWORD"],
        host=connection.settings_dict["HOST"] or "127.0.0.1",
        port=connection.settings_dict["PORT"] or 5432,
        autocommit=True,
    )
    limit = f'ALTER DATABASE "{name}" CONNECTION LIMIT %s'
    try:
        reopen = threading.Timer(3.0, admin.execute, args=[limit % -1])
        reopen.start()
        timer = durable.schedule(chaos.drop_own_session, args=["refused", True])
        clock.advance(1_000)
        engine.tick()
        assert wait_for(lambda: Timer.objects.get(pk=timer.pk).state != "firing", 20.0)
        reopen.join()
    finally:
        admin.execute(limit % -1)
        admin.close()
    row = Timer.objects.get(pk=timer.pk)
    assert (row.state, row.attempts) == ("fired", 1)
    assert list(FireRecord.objects.values_list("key", flat=True)) == ["refused"]
