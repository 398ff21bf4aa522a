"""What one firing batch costs in round trips to PostgreSQL, pinned.

Behind a pooler every round trip is a trip through it, and unprepared (PgBouncer 1.18 in
transaction mode) every statement is planned again: the fire path's cost is its count of
statements per batch (docs/benchmarks.md, "Behind PgBouncer"). A batch of any size, over
any number of shards, takes five besides its handlers' own: the attempt count (one
statement in autocommit, its own transaction), then ``BEGIN``, the fenced lock (which
also sets the idle guard), the ``UPDATE`` marking them fired, ``COMMIT``.

Round trips are read from libpq's protocol trace of the test's connection (each ends
with the server's ReadyForQuery), so a statement the ORM or an execute wrapper sends
behind Django's back counts too.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.db import connection, transaction

import durable
from durable.models import Timer
from durable.storage import firing, leases
from testproject.demo import probes
from tests.integration.sharding_support import keys_in_shards, make_due

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@contextmanager
def round_trips() -> Iterator[list[list[str]]]:
    """The connection's round trips inside the block: the client's messages of each."""
    from psycopg import pq

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    trips: list[list[str]] = []
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield trips
        finally:
            pgconn.untrace()  # flushes the trace
        trace.seek(0)
        current: list[str] = []
        for line in trace:
            direction, _, message, *rest = [*line.rstrip("\n").split("\t"), ""]
            if direction == "F" and message in ("Query", "Parse", "Bind"):
                current.append(f"{message} {rest[0].strip()}")
            elif direction == "B" and message == "ReadyForQuery":
                trips.append(current)
                current = []


def _keys(shards: int, per_shard: int, total_shards: int) -> list[str]:
    found = keys_in_shards("trip", shards, per_shard, total_shards)
    return [key for keys in found.values() for key in keys]


@pytest.fixture
def engine(start_engine):
    return start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0})


@pytest.mark.parametrize(("shards", "per_shard"), [(1, 1), (4, 5)])
def test_a_batch_costs_five_round_trips_besides_its_handlers(engine, clock, shards, per_shard):
    keys = _keys(shards, per_shard, 4)
    now = make_due(engine, clock, keys)
    work = [(runner, runner.due(now)) for runner in engine.runners.values()]
    work = [(runner, ids) for runner, ids in work if ids]
    assert len(work) == shards and sum(len(ids) for _, ids in work) == len(keys)

    with round_trips() as trips:
        outcomes = engine.firer.fire(work)

    assert sum(len(o.fired) for o in outcomes.values()) == len(keys)
    handlers = [t for t in trips if any("demo_firerecord" in m for m in t)]
    ours = [t for t in trips if t not in handlers]
    assert len(handlers) == len(keys), trips
    # The count (no BEGIN before it: autocommit), then BEGIN, lock, mark fired, COMMIT.
    assert len(ours) == 5, ours
    assert ours[0] != ['Query "BEGIN"'] and ours[1] == ['Query "BEGIN"'], ours
    assert ours[-1] == ['Query "COMMIT"'], ours
    assert set(Timer.objects.values_list("state", "attempts").distinct()) == {("fired", 1)}


def test_the_first_statement_of_a_batch_sets_the_idle_guard(engine, clock):
    """The guard's timeout rides in the lock (or the fence after it) instead of a
    statement of its own, and holds for the rest of the transaction."""
    tokens = {shard: runner.token for shard, runner in engine.runners.items()}

    def timeout() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW idle_in_transaction_session_timeout")
            return cursor.fetchone()[0]

    timer = durable.schedule(probes.record, args=["g"], key="g")
    with round_trips() as trips, transaction.atomic():
        stale, due = firing.fence_and_lock_due("default", tokens, [timer.pk], clock.now_ms())
        assert (stale, [t.id for t in due]) == ({}, [timer.pk])
        assert timeout() == "20s"  # 2 x LEASE_TTL_S
    assert len(trips) == 4, trips  # BEGIN, the lock, SHOW, COMMIT: no set_config of its own
    assert "'20000'" in " ".join(trips[1]), trips

    # Nothing due: the lock finds no row, and the fence after it sets the guard.
    with transaction.atomic():
        assert firing.fence_and_lock_due("default", tokens, [-1], clock.now_ms()) == ({}, [])
        assert timeout() == "20s"
    with transaction.atomic():
        assert leases.fence_shards("default", tokens) == {}
        assert timeout() == "20s"
    assert timeout() == "0"  # per transaction, never the session's
