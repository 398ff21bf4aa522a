"""Leases taken in a turn that a database error cuts short are still served.

Found by the chaos run (``make chaos``, seed 20261202): a restarted worker took over 28
shards, a transaction each, and the nemesis terminated its session before the last; the
list of the shards already taken was lost with the error, so they stayed owned by that
worker (a fresh lease, a new token) and served by nobody until they expired,
``LEASE_TTL_S`` later, when another worker took them over: timers due in them fired 10 s
late or more. Now each lease is recorded the moment it is taken
(``LeaseKeeper.unloaded``) and the next turn loads what the failed one did not.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import InterfaceError, OperationalError, connection

import durable
from durable.models import ShardLease, Timer, TimerState
from durable.storage import leases
from durable.worker.engine import Engine
from testproject.demo import chaos
from testproject.demo.models import FireRecord

pytestmark = pytest.mark.django_db(transaction=True)

SETTINGS = {"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}


def turn(engine, clock, step_ms=200):
    """One turn as ``Engine.run`` takes it: a database error ends it (no backoff here)."""
    clock.advance(step_ms)
    try:
        engine.tick()
    except (OperationalError, InterfaceError) as exc:
        engine._on_database_error(exc, 0.0)
        return exc
    return None


@pytest.mark.postgres
def test_leases_taken_before_a_database_error_are_served_on_the_next_turn(
    clock, settings, monkeypatch
):
    settings.DURABLE = dict(SETTINGS)
    timers = [
        durable.schedule(chaos.atomic, args=[f"t{i}"], delay=timedelta(milliseconds=100))
        for i in range(16)
    ]
    assert {t.shard for t in timers} == {0, 1, 2, 3}
    take = leases.acquire
    calls = []

    def session_dies_at_the_third(db, shard, *args, **kwargs):
        calls.append(shard)
        if len(calls) == 3:  # the nemesis terminates the session mid-way
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return take(db, shard, *args, **kwargs)

    monkeypatch.setattr(leases, "acquire", session_dies_at_the_third)
    engine = Engine(node="survivor", clock=clock, threads=1)
    try:
        engine.start()
        assert turn(engine, clock) is not None  # the turn ended on the error
        owned = set(ShardLease.objects.filter(owner="survivor").values_list("shard", flat=True))
        assert owned == {0, 1}  # taken before the error, not served yet

        for _ in range(3):  # well within the lease's 10 s
            assert turn(engine, clock) is None

        assert sorted(engine.runners) == [0, 1, 2, 3]
        for timer in timers:
            timer.refresh_from_db()
            assert timer.state == TimerState.FIRED, timer.shard
        assert FireRecord.objects.filter(key__startswith="t").count() == 16
        # The shards taken before the error kept the token they were taken with.
        tokens = dict(ShardLease.objects.values_list("shard", "token"))
        assert {s: engine.runners[s].token for s in (0, 1)} == {0: tokens[0], 1: tokens[1]}
        assert Timer.objects.exclude(state=TimerState.FIRED).count() == 0
    finally:
        engine.executor.shutdown(wait=True)
