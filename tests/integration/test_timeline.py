"""The worker refuses a server on an older timeline than one it has used (an old primary
that came back after a failover): ``durable.storage.timeline``. The whole story, with a
real failover and a worker process, is in tests/acceptance/test_failover.py."""

from __future__ import annotations

import pytest
from django.db import connections

from durable.storage import timeline
from durable.worker.engine import Engine

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def fresh_memory():
    timeline.forget()
    yield
    timeline.forget()


def test_a_primary_is_read_as_its_system_and_timeline():
    conn = connections["default"]
    conn.ensure_connection()
    system, line = timeline.read_position(conn)
    assert system.isdigit() and line >= 1


def test_the_same_or_a_newer_timeline_is_accepted_and_remembered():
    conn = connections["default"]
    conn.ensure_connection()
    system, line = timeline.read_position(conn)
    timeline.check(conn)
    timeline.check(conn)
    assert timeline._highest == {system: line}


def test_an_older_timeline_is_refused_and_the_connection_closed():
    conn = connections["default"]
    conn.ensure_connection()
    system, line = timeline.read_position(conn)
    timeline._highest[system] = line + 1  # as if this process had used a promoted replica
    with pytest.raises(timeline.StalePrimaryError, match=f"timeline {line} of system"):
        timeline.check(conn)
    assert conn.connection is None  # closed: Django must connect (and ask) again


def test_the_engine_refuses_a_new_connection_to_a_stale_server():
    conn = connections["default"]
    conn.ensure_connection()
    system, line = timeline.read_position(conn)
    engine = Engine(node="timeline-test")
    engine.start()
    try:
        conn.close()
        timeline._highest[system] = line + 1
        with pytest.raises(timeline.StalePrimaryError):
            conn.ensure_connection()
        assert conn.connection is None
        timeline.forget()
        conn.ensure_connection()  # a current server is used again
    finally:
        engine.shutdown(wait_s=1)
