"""Concurrency keys on workflows across two real workers: never more than the limit in
progress, all complete, a kill changes nothing (issue 19).

1,000 runs of ``limited_slot`` over 10 accounts, ``max_concurrency=2``, started by four
transactions that take their ids in one order and commit in the reverse. Each run enters
(an atomic step that adds one to its account's row), sleeps, and leaves (an atomic step
that takes one off): the row keeps the most runs that were ever inside at once, under its
row lock, so the database itself proves the limit held, across the sleeps. One worker is
killed with SIGKILL mid-way: its runs in progress keep their slots (they are running,
sleeping) until the survivor resumes them.
"""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.db.models import Count

from durable.models import WorkflowRun
from tests.acceptance import workflows
from tests.acceptance.helpers import metric, owned_by, write_out_of_id_order

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ACCOUNTS, PER_ACCOUNT, LIMIT = 10, 100, 2
PAUSE_MS = 30  # each run's sleep between its enter and leave steps
TTL = {"DURABLE_LEASE_TTL_S": "3"}  # a quick takeover after the kill


@pytest.fixture
def workers(routed_workers):
    """Run twice: workers connected directly, then through PgBouncer in transaction mode
    (the keyed decision sends its lock and count in one pipeline)."""
    return routed_workers


@pytest.fixture
def slots():
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {workflows.WF_SLOTS} (account text PRIMARY KEY, "
            "active integer NOT NULL, peak integer NOT NULL)"
        )
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {workflows.WF_LEDGER} (id bigserial PRIMARY KEY, "
            "account text, n integer, delta integer, active integer, pid integer, "
            "at timestamptz)"
        )
        cursor.execute(f"TRUNCATE {workflows.WF_SLOTS}, {workflows.WF_LEDGER}")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {workflows.WF_SLOTS}, {workflows.WF_LEDGER}")


def start_out_of_order() -> None:
    """Four transactions start 250 runs each, taking their ids in order (0 first) and
    committing in reverse (3 first, 0 last and a second and a half later): runs with
    smaller ids, started earlier, appear after later ones have run."""

    def write(part: int) -> None:
        workflows.limited_slot.start_many(
            {"args": [f"acct{n % ACCOUNTS}", n, PAUSE_MS]}
            for n in range(part * 250, part * 250 + 250)
        )

    write_out_of_id_order(write)


def left() -> int:
    """Runs that have left (their second atomic step committed)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {workflows.WF_LEDGER} WHERE delta < 0")
        return int(cursor.fetchone()[0])


def test_two_workers_never_have_more_than_the_limit_of_runs_in_progress_per_key(
    workers, slots, record_property
):
    workers.start("w1", "--threads", "20", env=TTL)
    workers.start("w2", "--threads", "20", env=TTL)
    workers.wait_until(
        lambda: owned_by("w1") and owned_by("w2"),
        timeout_s=30,
        what="both workers holding shards",
        require_alive=["w1", "w2"],
    )
    started = time.monotonic()
    start_out_of_order()
    total = ACCOUNTS * PER_ACCOUNT
    # The accounts' shards (a keyed run lives on its key's): both workers must own some.
    shards = set(WorkflowRun.objects.values_list("shard", flat=True))
    assert shards & set(owned_by("w1")) and shards & set(owned_by("w2")), "one worker idle"
    assert len(shards) > 1

    workers.wait_until(
        lambda: left() >= total * 3 // 10, timeout_s=90, what="30% done", require_alive=["w1"]
    )
    metric(record_property, "killed_after_s", round(time.monotonic() - started, 2))
    workers.workers["w1"].kill()
    done_at_kill = left()
    assert done_at_kill < total, "everything was done before the kill: nothing was tested"

    workers.wait_until(
        lambda: WorkflowRun.objects.filter(state="completed").count() == total,
        timeout_s=180,
        what=f"all {total} runs completed",
        require_alive=["w2"],
        explain=lambda: dict(WorkflowRun.objects.values_list("state").annotate(n=Count("id"))),
    )
    took = time.monotonic() - started
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT account, active, peak FROM {workflows.WF_SLOTS}")
        rows = {account: (active, peak) for account, active, peak in cursor.fetchall()}
        cursor.execute(
            f"SELECT n, count(*) FILTER (WHERE delta > 0), count(*) FILTER (WHERE delta < 0) "
            f"FROM {workflows.WF_LEDGER} GROUP BY n"
        )
        per_run = {n: (enters, leaves) for n, enters, leaves in cursor.fetchall()}
        cursor.execute(f"SELECT max(active) FROM {workflows.WF_LEDGER}")
        most = cursor.fetchone()[0]
    assert set(rows) == {f"acct{i}" for i in range(ACCOUNTS)}
    peaks = {account: peak for account, (_active, peak) in rows.items()}
    assert max(peaks.values()) <= LIMIT and most <= LIMIT, peaks
    assert min(peaks.values()) == LIMIT, f"the limit was never reached: {peaks}"
    assert all(active == 0 for active, _peak in rows.values()), rows
    assert per_run == {n: (1, 1) for n in range(total)}, "each step committed exactly once"
    metric(record_property, "done_at_kill", done_at_kill)
    metric(record_property, "all_done_s", round(took, 2))
