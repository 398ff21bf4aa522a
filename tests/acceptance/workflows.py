"""Workflows only the acceptance tests run; worker processes import them by dotted name."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import durable
from testproject.demo.models import FireRecord


def wall_ms() -> int:
    """The real clock (the workers' clock), in epoch ms."""
    return time.time_ns() // 1_000_000


def slow_outside(key: str, marker: str, seconds: float) -> str:
    """An outside step: its row commits at once; the first run then lingers ``seconds``."""
    FireRecord.objects.create(key=key, fired_at_ms=wall_ms())
    if not Path(marker).exists():
        Path(marker).write_text(key)
        time.sleep(seconds)
    return key


def slow_atomic(key: str, marker: str, seconds: float) -> str:
    """An atomic step's function: its row commits with the step's record, or never."""
    FireRecord.objects.create(key=key, fired_at_ms=wall_ms())
    if not Path(marker).exists():
        Path(marker).write_text(key)
        time.sleep(seconds)
    return key


def record(key: str, due_ms: int | None = None) -> str:
    """Write one row for ``key``, stamped with the real time (and when it was due)."""
    FireRecord.objects.create(key=key, fired_at_ms=wall_ms(), due_at_ms=due_ms)
    return key


@durable.workflow
def crash_in_outside_step(ctx, key, marker, seconds):
    """An outside step the worker is killed in, then a last atomic step."""
    ctx.step(slow_outside, key, marker, seconds)
    ctx.atomic(record, f"{key}:after")
    return "done"


@durable.workflow
def crash_in_atomic_step(ctx, key, marker, seconds):
    """An atomic step the worker is killed in, then a last atomic step."""
    ctx.atomic(slow_atomic, key, marker, seconds)
    ctx.atomic(record, f"{key}:after")
    return "done"


@durable.workflow
def sleep_then_record(ctx, key, seconds):
    """Sleep on the real clock, then record when it woke up and when it was due."""
    started = ctx.now()
    ctx.sleep(timedelta(seconds=seconds))
    due_ms = int(started.timestamp() * 1000) + int(seconds * 1000)
    ctx.atomic(record, key, due_ms)
    return due_ms


def double(value: int) -> int:
    """A cheap outside step."""
    return value * 2


@durable.workflow
def three_steps(ctx, index):
    """Two outside steps and an atomic one that records ``w<index>`` exactly once."""
    value = ctx.step(double, index)
    value = ctx.step(double, value)
    ctx.atomic(record, f"w{index}")
    return value


def pause(value: int, seconds: float) -> int:
    """An outside step that takes ``seconds``."""
    time.sleep(seconds)
    return value


@durable.workflow
def two_pauses(ctx, index, seconds):
    """Two outside steps of ``seconds`` each, then an atomic record of ``s<index>``."""
    ctx.step(pause, index, seconds)
    ctx.step(pause, index, seconds)
    ctx.atomic(record, f"s{index}")
    return index


def at_ms(ms: int) -> datetime:
    """Epoch ms as an aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


@durable.workflow
def sleep_until_then_record(ctx, key, wake_ms):
    """Sleep until ``wake_ms`` (all runs of a test wake at one instant), then record
    ``key`` in a ``ctx.atomic`` step: the row commits with the step's record, or never.
    The run's end is a checkpoint of its own, after it."""
    ctx.sleep_until(at_ms(wake_ms))
    ctx.atomic(record, key)
    return key


@durable.workflow
def nap(ctx, seconds):
    """Sleep ``seconds``, then end (the run's row says when)."""
    ctx.sleep(timedelta(seconds=seconds))
    return seconds


#: Per account: runs of :func:`limited_slot` between their enter and leave steps now,
#: and the most there ever were (``test_workflow_concurrency_cluster.py`` creates it).
WF_SLOTS = "wf_concurrency_slots"
#: Every enter and leave, with the count it left (ids in commit-lock order per account).
WF_LEDGER = "wf_concurrency_ledger"


def account_of_run(account: str, n: int, pause_ms: int) -> str:
    """The concurrency key of a :func:`limited_slot` run."""
    return account


def slot_event(account: str, n: int, delta: int) -> int:
    """An atomic step: add ``delta`` to the account's count of runs inside, keep its peak
    (the row lock orders every worker's steps), and log it; return the new count."""
    import os

    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {WF_SLOTS} AS s (account, active, peak) VALUES (%s, %s, %s) "
            "ON CONFLICT (account) DO UPDATE SET active = s.active + EXCLUDED.active, "
            "peak = GREATEST(s.peak, s.active + EXCLUDED.active) RETURNING active",
            [account, delta, max(delta, 0)],
        )
        active = cursor.fetchone()[0]
        cursor.execute(
            f"INSERT INTO {WF_LEDGER} (account, n, delta, active, pid, at) "
            "VALUES (%s, %s, %s, %s, %s, clock_timestamp())",
            [account, n, delta, active, os.getpid()],
        )
    return int(active)


@durable.workflow(concurrency_key=account_of_run, max_concurrency=2)
def limited_slot(ctx, account, n, pause_ms):
    """Enter (an atomic step), sleep ``pause_ms``, leave: at most two per account inside."""
    ctx.atomic(slot_event, account, n, 1)
    ctx.sleep(timedelta(milliseconds=pause_ms))
    ctx.atomic(slot_event, account, n, -1)
    return n
