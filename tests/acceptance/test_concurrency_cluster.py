"""Concurrency keys across two real workers: never more than the limit, all done, a kill
changes nothing (issue 19).

1,000 timers over 10 accounts, ``max_concurrency=2``, committed by four transactions in
the reverse of their id order. Each attempt writes ``start`` and ``end`` rows to a
ledger stamped by the database's clock; sweeping each account's rows proves that no more
than two attempts ever ran at once. One worker is killed with SIGKILL mid-way: its
running attempts end there (it can write nothing more), and their timers, still claimed,
keep their slots until the survivor re-runs them.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.db.models import Count

import durable
from durable.models import Timer
from tests.acceptance import handlers
from tests.acceptance.helpers import metric, owned_by, write_out_of_id_order

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ACCOUNTS, PER_ACCOUNT, LIMIT = 10, 100, 2
SECONDS = 0.02  # each attempt's length: long enough to overlap, short enough for CI
TTL = {"DURABLE_LEASE_TTL_S": "3"}  # a quick takeover after the kill


@pytest.fixture
def workers(routed_workers):
    """Run twice: workers connected directly, then through PgBouncer in transaction mode
    (the keyed decision sends its lock and count in one pipeline)."""
    return routed_workers


@pytest.fixture
def ledger():
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {handlers.LEDGER} (id bigserial PRIMARY KEY, "
            "account text, n integer, pid integer, event text, at timestamptz)"
        )
        cursor.execute(f"TRUNCATE {handlers.LEDGER}")
    yield handlers.LEDGER
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {handlers.LEDGER}")


def schedule_out_of_order(due: datetime) -> None:
    """Four transactions take their ids in order (0 first) and commit in reverse (3 first),
    0 last and after the first timers are due, so rows with smaller ids (and earlier due
    times) appear after larger ones have fired."""

    def write(part: int) -> None:
        durable.schedule_many(
            {
                "fn": handlers.ledgered,
                "args": [f"acct{n % ACCOUNTS}", n, SECONDS],
                "at": due + timedelta(milliseconds=n),
            }
            for n in range(part * 250, part * 250 + 250)
        )

    write_out_of_id_order(write)


def most_at_once(rows: list[tuple], killed_pid: int, killed_at: datetime) -> dict[str, int]:
    """Per account, the most attempts running at once; a start of the killed worker that
    has no end ended when it was killed."""
    events: dict[str, list[tuple[datetime, int]]] = {}
    open_starts: dict[tuple, datetime] = {}
    for account, n, pid, event, at in rows:
        if event == "start":
            open_starts[(account, n, pid)] = at
            events.setdefault(account, []).append((at, +1))
        else:
            del open_starts[(account, n, pid)]
            events.setdefault(account, []).append((at, -1))
    for (account, _n, pid), _at in open_starts.items():
        assert pid == killed_pid, f"an attempt of the live worker never ended: {account} {_n}"
        events[account].append((killed_at, -1))
    most = {}
    for account, marks in events.items():
        running = peak = 0
        for _at, step in sorted(marks):  # at a tie, an end (-1) sorts before a start
            running += step
            peak = max(peak, running)
        most[account] = peak
    return most


def test_two_workers_never_run_more_than_the_limit_per_key(workers, ledger, record_property):
    # Twenty handler threads each: enough for every account's two slots on one worker.
    workers.start("w1", "--threads", "20", env=TTL)
    workers.start("w2", "--threads", "20", env=TTL)
    workers.wait_until(
        lambda: owned_by("w1") and owned_by("w2"),
        timeout_s=30,
        what="both workers holding shards",
        require_alive=["w1", "w2"],
    )
    started = time.monotonic()
    schedule_out_of_order(datetime.now(UTC) + timedelta(milliseconds=300))
    total = ACCOUNTS * PER_ACCOUNT
    # The accounts' shards: the test needs both workers to fire some.
    shards = set(Timer.objects.values_list("shard", flat=True))
    assert shards & set(owned_by("w1")) and shards & set(owned_by("w2")), "one worker idle"

    def ended() -> int:
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {ledger} WHERE event = 'end'")
            return cursor.fetchone()[0]

    workers.wait_until(
        lambda: ended() >= total * 3 // 10, timeout_s=60, what="30% done", require_alive=["w1"]
    )
    metric(record_property, "killed_after_s", round(time.monotonic() - started, 2))
    victim_pid = workers.workers["w1"].proc.pid
    workers.workers["w1"].kill()
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        killed_at = cursor.fetchone()[0]
    done_at_kill = ended()
    assert done_at_kill < total, "everything was done before the kill: nothing was tested"

    workers.wait_until(
        lambda: Timer.objects.filter(state="fired").count() == total,
        timeout_s=90,
        what=f"all {total} timers fired",
        require_alive=["w2"],
        explain=lambda: dict(Timer.objects.values_list("state").annotate(n=Count("id"))),
    )
    took = time.monotonic() - started
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT account, n, pid, event, at FROM {ledger} ORDER BY at, event")
        rows = cursor.fetchall()
    peaks = most_at_once(rows, victim_pid, killed_at)
    assert set(peaks) == {f"acct{i}" for i in range(ACCOUNTS)}
    assert max(peaks.values()) <= LIMIT, peaks
    assert min(peaks.values()) == LIMIT, f"the limit was never reached: {peaks}"
    finished = {(account, n) for account, n, _pid, event, _at in rows if event == "end"}
    assert len(finished) == total, "every call completed at least once"
    metric(record_property, "done_at_kill", done_at_kill)
    metric(record_property, "all_done_s", round(took, 2))
