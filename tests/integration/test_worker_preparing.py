"""The worker prepares its own hot statements on PostgreSQL, with Django's defaults.

Django leaves psycopg's ``prepare_threshold`` at None; the worker sets it on its own
connections to ``DATABASE`` (``durable.storage.statements.prepare_on``) unless the
database is pooled (``LISTEN_DATABASE``) or ``PREPARE_STATEMENTS`` is False, and keeps a
threshold the project chose.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from durable.conf import get_settings
from durable.storage import statements

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def unprepared():
    """The default connection as Django's defaults leave it: nothing prepared."""
    conn = connections["default"]
    conn.ensure_connection()
    saved = conn.connection.prepare_threshold
    conn.connection.prepare_threshold = None
    yield conn
    conn.connection.prepare_threshold = saved


def test_should_prepare_follows_the_setting_and_the_pooled_hint(settings):
    settings.DURABLE = {}
    assert statements.should_prepare(get_settings()) is True
    settings.DURABLE = {"PREPARE_STATEMENTS": False}
    assert statements.should_prepare(get_settings()) is False
    settings.DATABASES["listen"] = settings.DATABASES["default"]
    try:
        settings.DURABLE = {"LISTEN_DATABASE": "listen"}
        assert statements.should_prepare(get_settings()) is False
        settings.DURABLE = {"LISTEN_DATABASE": "listen", "PREPARE_STATEMENTS": True}
        assert statements.should_prepare(get_settings()) is True
    finally:
        del settings.DATABASES["listen"]


def test_the_hot_statements_are_prepared_after_prepare_on(unprepared):
    assert statements.prepare_on(unprepared) is True
    sql = "SELECT %s::bigint + 1"
    for i in range(statements.WORKER_PREPARE_THRESHOLD + 1):
        with statements.cursor("default") as cursor:
            cursor.execute(sql, [i])
    with unprepared.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements")
        assert cursor.fetchone()[0] >= 1
    # A threshold the project chose is kept.
    unprepared.connection.prepare_threshold = 2
    assert statements.prepare_on(unprepared) is False
    assert unprepared.connection.prepare_threshold == 2


def test_a_worker_thread_connection_prepares_by_default(start_engine, clock):
    engine = start_engine({"SHARDS": 1})
    seen = {}

    def in_thread():
        conn = connections["default"]
        conn.ensure_connection()  # a new connection of a pool thread: connection_created
        seen["threshold"] = conn.connection.prepare_threshold
        conn.close()

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen["threshold"] == statements.WORKER_PREPARE_THRESHOLD
    assert engine.conf.PREPARE_STATEMENTS is None
