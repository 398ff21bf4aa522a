"""``schedule()`` one per transaction costs one round trip on PostgreSQL (issue 16).

The INSERT and its NOTIFY are one statement (``durable.storage.single``), and in
autocommit mode no BEGIN/COMMIT pair is sent around it: the statement is its own
transaction. Round trips are counted on the wire, with libpq's trace of what the client
sends: each simple ``Query`` or extended-protocol ``Sync`` is one round trip.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.db.models.signals import post_save
from django.test.utils import CaptureQueriesContext

import durable
from durable.models import Timer
from durable.testing import ManualClock, override_clock
from testproject.demo import handlers as h

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def clock():
    with override_clock(ManualClock(start_ms=1_700_000_000_000)) as manual:
        yield manual


def sent(call):  # type: ignore[no-untyped-def]
    """Run ``call()``; return what the client sent, one message name per entry."""
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        try:
            call()
        finally:
            pgconn.untrace()
        trace.seek(0)
        lines = [line.split("\t") for line in trace.read().splitlines()]
    return [fields[3].strip() for fields in lines if len(fields) > 3 and fields[1] == "F"]


def round_trips(messages: list[str]) -> int:
    return sum(name in ("Query", "Sync") for name in messages)


def test_a_near_term_timer_in_autocommit_is_one_round_trip(clock):
    messages = sent(lambda: durable.schedule(h.noop))
    assert round_trips(messages) == 1, messages  # no BEGIN, no separate pg_notify, no COMMIT
    assert Timer.objects.count() == 1


@pytest.mark.parametrize("delay", [timedelta(0), timedelta(days=1)], ids=["near", "far"])
def test_in_the_callers_transaction_it_is_one_statement(clock, delay):
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        timer = durable.schedule(h.noop, delay=delay)
    assert len(queries) == 1, [q["sql"] for q in queries]
    assert ("pg_notify" in queries[0]["sql"]) == (delay == timedelta(0))
    assert Timer.objects.get().pk == timer.pk


def test_a_new_key_is_one_statement_a_taken_key_two(clock):
    with CaptureQueriesContext(connection) as queries:
        first = durable.schedule(h.noop, key="k")
    assert len(queries) == 1
    with CaptureQueriesContext(connection) as queries:
        again = durable.schedule(h.noop, key="k")
    assert len(queries) == 2  # the insert that found the key taken, then the row's read
    assert again.pk == first.pk and Timer.objects.count() == 1


def test_a_post_save_listener_still_hears_each_timer(clock):
    heard = []

    def listener(sender, instance, created, **kwargs):  # type: ignore[no-untyped-def]
        heard.append((instance.pk, created))

    post_save.connect(listener, sender=Timer)
    try:
        timer = durable.schedule(h.noop)
    finally:
        post_save.disconnect(listener, sender=Timer)
    assert heard == [(timer.pk, True)]
