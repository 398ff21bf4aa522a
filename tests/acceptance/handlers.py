"""Handlers only the acceptance tests need; workers import them by dotted name."""

from __future__ import annotations

import time
from pathlib import Path

import durable
from durable.dispatch.context import current_fire
from durable.exceptions import HandlerTimeout
from testproject.demo.models import FireRecord


@durable.handler(max_attempts=1)
def record_slowly(key: str, marker: str, seconds: float) -> str:
    """Record ``key`` like ``probes.record``, then say so in ``marker`` and take ``seconds``.

    The worker sits inside its firing transaction (holding its shard's lease row lock)
    for ``seconds`` after the marker file appears: a test can freeze it exactly there.
    """
    ctx = current_fire()
    assert ctx is not None
    FireRecord.objects.create(key=key, fired_at_ms=ctx.fired_ms, due_at_ms=ctx.scheduled_ms)
    Path(marker).write_text(key)
    time.sleep(seconds)
    return key


@durable.handler(atomic=False, max_attempts=1)
def record_externally_slowly(key: str, marker: str, seconds: float) -> str:
    """An outside-effect handler that says it started in ``marker``, waits, then records.

    It runs on the worker's executor with no transaction open: a test can freeze the
    worker there without holding any lock, and see whether its completion is fenced.
    """
    ctx = current_fire()
    assert ctx is not None
    Path(marker).write_text(key)
    time.sleep(seconds)
    fired_ms = time.time_ns() // 1_000_000
    FireRecord.objects.create(key=key, fired_at_ms=fired_ms, due_at_ms=ctx.scheduled_ms)
    return key


@durable.handler(atomic=False)
def outside_pause(key: str, seconds: float) -> str:
    """An outside-effect handler (default policy) that takes ``seconds``, then records."""
    time.sleep(seconds)
    FireRecord.objects.create(key=key, fired_at_ms=time.time_ns() // 1_000_000)
    return key


@durable.handler(max_attempts=3)
def overstay(key: str, marker: str, seconds: float) -> str:
    """An atomic handler whose first run ignores its deadline and lasts ``seconds``.

    It records ``key`` first, so the row commits with the fire or not at all. The first
    run (no ``marker`` yet) swallows the ``HandlerTimeout`` the worker raises in it, as a
    handler with a broad ``except`` does, and so holds its batch past ``LEASE_TTL_S``;
    any later run returns at once.
    """
    ctx = current_fire()
    assert ctx is not None
    FireRecord.objects.create(key=key, fired_at_ms=ctx.fired_ms, due_at_ms=ctx.scheduled_ms)
    if Path(marker).exists():
        return key
    Path(marker).write_text(key)
    end = time.monotonic() + seconds
    while True:  # re-entered only after the one HandlerTimeout was swallowed
        try:  # a broad except, as handlers have, around the whole wait: the alarm can
            # land between two calls of the loop, not only in time.sleep (CI saw one
            # escape, fail the attempt and run again as attempt 2)
            while time.monotonic() < end:
                time.sleep(0.02)
            return key
        except HandlerTimeout:
            continue


@durable.handler(atomic=False)
def linger_first(key: str, seconds: float) -> str:
    """An outside handler whose first attempt takes ``seconds``; later ones record at once.

    So a test can leave first attempts in flight in a worker it stops, and see the next
    owner's re-runs finish quickly.
    """
    ctx = current_fire()
    assert ctx is not None
    if ctx.attempt == 1:
        time.sleep(seconds)
    FireRecord.objects.create(key=key, fired_at_ms=time.time_ns() // 1_000_000)
    return key


#: The ledger :func:`ledgered` writes (created by its test): one row when an attempt
#: starts and one when it ends, stamped by the database's clock.
LEDGER = "concurrency_ledger"


def account_of(account: str, n: int, seconds: float) -> str:
    """The concurrency key of a :func:`ledgered` call."""
    return account


@durable.handler(atomic=False, concurrency_key=account_of, max_concurrency=2, max_attempts=20)
def ledgered(account: str, n: int, seconds: float) -> None:
    """Write ``start`` to the ledger, take ``seconds``, write ``end``: at most two per account."""
    import os

    from django.db import connection

    def write(event: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {LEDGER} (account, n, pid, event, at) "
                "VALUES (%s, %s, %s, %s, clock_timestamp())",
                [account, n, os.getpid(), event],
            )

    write("start")
    time.sleep(seconds)
    write("end")
