"""The admin on PostgreSQL with 1,000,000 timers and 100,000 workflow runs.

The rows are inserted once for the module with ``INSERT ... SELECT generate_series``
(seconds, not minutes), then ``VACUUM ANALYZE`` as autovacuum would do. Each admin page
is fetched with the test client while every query is captured, and then:

- the page takes a bounded number of queries and renders in bounded time;
- no ``COUNT(*)`` runs unbounded over a big table (counts are estimated or capped);
- ``EXPLAIN`` of every captured query on a big table shows no sequential scan of it.

Run alone: ``DATABASE_URL=postgres://.../durable_admin .venv/bin/python -m pytest
tests/integration/test_admin_scale.py -s`` (``-s`` prints the per-page figures).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

TIMERS = 1_000_000
RUNS = 100_000
BIG_TABLES = ("durable_timer", "durable_workflowrun", "durable_workflowstep")
MAX_QUERIES = 12
MAX_SECONDS = 2.0
BUSY_RUN = "run-0000007"  # has 300 recorded steps

# A day of history and nine days ahead: every 0.9 s a timer is due. Those due more than
# ten minutes ago have fired (their rows stamped at their fire time, as the worker
# does); a few failed, are being fired, or were cancelled; the rest are pending.
TIMER_SQL = """
INSERT INTO durable_timer (shard, bucket, fire_at_ms, state, kind, target, args, kwargs, key,
    attempts, max_attempts, backoff_base_s, backoff_max_s, parent_id, on_complete, context,
    result, fired_token, claim_expires_ms, last_error, created_at, updated_at, fired_at)
SELECT g %% 64, (t.base + g * 900) >> 16, t.base + g * 900, s.state,
    'handler', 'myapp.tasks.job' || (g %% 40), '[]'::jsonb, '{}'::jsonb,
    CASE WHEN g %% 5 = 0 THEN 'order:' || g END,
    CASE WHEN s.state = 'failed' THEN 5 ELSE 0 END, 5, 1.0, 3600.0, NULL, '', NULL, NULL, NULL,
    CASE WHEN s.state = 'firing' THEN t.base + g * 900 + 60000 END,
    CASE WHEN s.state = 'failed' THEN 'RuntimeError: boom' ELSE '' END,
    s.stamp - interval '1 hour', s.stamp, CASE WHEN s.state = 'fired' THEN s.stamp END
FROM generate_series(1, %s) AS g,
    LATERAL (SELECT (extract(epoch FROM now()) * 1000)::bigint - 86400000 AS base) AS t,
    LATERAL (SELECT
        CASE WHEN g %% 997 = 0 THEN 'failed' WHEN g %% 1999 = 0 THEN 'firing'
             WHEN g %% 50 = 1 THEN 'canceled' WHEN g * 900 < 86400000 - 600000 THEN 'fired'
             ELSE 'pending' END AS state,
        least(now(), to_timestamp((t.base + g * 900) / 1000.0)) AS stamp) AS s
"""

RUN_SQL = """
INSERT INTO durable_workflowrun (id, name, state, shard, args, kwargs, model_label,
    object_pk, parent_id, result, error, wait_signal, wait_seq, replays, retries,
    created_at, updated_at, finished_at)
SELECT 'run-' || lpad(g::text, 7, '0'),
    'testproject.demo.workflows.' || (ARRAY['onboarding', 'ten_steps', 'nap'])[1 + g %% 3],
    CASE WHEN g %% 101 = 0 THEN 'failed' WHEN g %% 3 = 0 THEN 'sleeping'
         WHEN g %% 7 = 0 THEN 'waiting' ELSE 'completed' END,
    g %% 64, '[]'::jsonb, '{}'::jsonb,
    CASE WHEN g %% 2 = 0 THEN 'demo.order' ELSE '' END,
    CASE WHEN g %% 2 = 0 THEN g::text ELSE '' END,
    NULL, NULL, CASE WHEN g %% 101 = 0 THEN 'StepFailed: boom' ELSE '' END, '', NULL, 1, 0,
    now() - g * interval '3 seconds', now() - g * interval '3 seconds', NULL
FROM generate_series(1, %s) AS g
"""

STEP_SQL = """
INSERT INTO durable_workflowstep (run_id, seq, kind, name, status, result, error, attempts,
    wake_ms, created_at, updated_at)
SELECT r.id, s, 'step', 'send_mail', 'done', '"ok"'::jsonb, '', 1, NULL::bigint, now(), now()
FROM durable_workflowrun r, generate_series(0, 1) AS s WHERE r.id LIKE '%%0'
UNION ALL
SELECT %s, s, 'step', 'increment', 'done', to_jsonb(s), '', 1, NULL, now(), now()
FROM generate_series(0, 299) AS s
"""


@pytest.fixture(scope="module")
def big_tables(django_db_setup, django_db_blocker):
    """Fill the tables once for the module (committed), empty them afterwards."""
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        started = time.perf_counter()
        with plain_indexes_dropped(cursor, BIG_TABLES):
            cursor.execute(TIMER_SQL, [TIMERS])
            cursor.execute(RUN_SQL, [RUNS])
            cursor.execute(STEP_SQL, [BUSY_RUN])
        for table in BIG_TABLES:
            cursor.execute(f"VACUUM ANALYZE {table}")  # what autovacuum does after a load
        loaded = time.perf_counter() - started
        print(f"\nloaded {TIMERS:,} timers and {RUNS:,} runs in {loaded:.1f} s")
        yield
        cursor.execute("TRUNCATE durable_workflowsignal, " + ", ".join(reversed(BIG_TABLES)))


@contextmanager
def plain_indexes_dropped(cursor, tables: tuple[str, ...]):
    """Drop the tables' non-constraint indexes for a bulk load, then build them again.

    Building an index once over a million rows is several times faster than updating
    eight indexes row by row; the indexes come back from PostgreSQL's own definitions
    (``pg_indexes.indexdef``), so the schema the test reads is the migrated one.
    """
    cursor.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = ANY(%s) "
        "AND indexname NOT IN (SELECT conname FROM pg_constraint)",
        [list(tables)],
    )
    definitions = cursor.fetchall()
    for name, _ in definitions:
        cursor.execute(f'DROP INDEX "{name}"')
    try:
        yield
    finally:
        cursor.execute("SET maintenance_work_mem = '256MB'")
        for _, definition in definitions:
            cursor.execute(definition)


@pytest.fixture
def admin_client(client, db):
    """A superuser's client, logged in without a password (hashing one costs a second)."""
    client.force_login(User.objects.create_superuser("admin", "admin@example.com", None))
    return client


def fetch(client, url: str, params: dict[str, str] | None = None) -> tuple[list[str], float]:
    """GET a page; return the SQL it ran and how long it took."""
    with CaptureQueriesContext(connection) as captured:
        started = time.perf_counter()
        response = client.get(url, params or {})
        elapsed = time.perf_counter() - started
    assert response.status_code == 200, (url, params, response.status_code)
    return [q["sql"] for q in captured.captured_queries], elapsed


def on_big_table(sql: str) -> bool:
    return any(f'"{table}"' in sql or f" {table} " in sql for table in BIG_TABLES)


def plan(sql: str) -> str:
    """The plan PostgreSQL ran ``sql`` with (EXPLAIN ANALYZE: real rows and timings)."""
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}")
        return "\n".join(row[0] for row in cursor.fetchall())


def check_page(client, label: str, url: str, params: dict[str, str] | None = None) -> None:
    queries, elapsed = fetch(client, url, params)
    big = [sql for sql in queries if on_big_table(sql) and sql.lstrip().startswith("SELECT")]
    plans = {sql: plan(sql) for sql in big}
    print(f"\n{label}: {len(queries)} queries, {elapsed * 1000:.0f} ms")
    for sql, text in plans.items():
        lines = text.splitlines()
        scans = [line.strip() for line in lines if " on durable_" in line][:2]
        print(f"  {sql[:110]}\n    {lines[-1].strip()}; {' / '.join(scans)}")
    assert len(queries) <= MAX_QUERIES, (label, queries)
    assert elapsed < MAX_SECONDS, (label, elapsed)
    for sql, text in plans.items():
        for table in BIG_TABLES:
            assert f"Seq Scan on {table}" not in text, (label, sql, text)
        if "COUNT(" in sql.upper() and "LIMIT" not in sql.upper():
            # Uncapped counts are allowed only where an index bounds them to a few rows.
            assert "rows=" in text and count_rows(text) <= 10_000, ("unbounded count", label, sql)


def count_rows(plan_text: str) -> int:
    """The most rows any node of a plan returned in all (EXPLAIN ANALYZE's actual rows
    times loops: a per-shard subplan run 64 times counts 64 times)."""
    found = []
    for line in plan_text.splitlines():
        if "actual" not in line or "rows=" not in line:
            continue
        rows = int(line.split("rows=")[1].split()[0].rstrip(")"))
        loops = int(line.split("loops=")[1].split(")")[0]) if "loops=" in line else 1
        found.append(rows * loops)
    return max(found, default=0)


TIMER_PAGES = {
    "timers": {},
    "timers, page 50": {"p": "50"},
    "timers pending": {"state__exact": "pending"},
    "timers failed": {"state__exact": "failed"},
    "timers firing": {"state__exact": "firing"},
    "timers fired": {"state__exact": "fired"},
    "timers fired, fire-time sort ignored": {"state__exact": "fired", "o": "5"},
    "timers canceled": {"state__exact": "canceled"},
    "timers canceled, by fire time": {"state__exact": "canceled", "o": "5"},
    "timers overdue": {"due": "overdue"},
    "timers due later, by fire time": {"due": "later", "o": "5"},
    "timers pending, by fire time": {"state__exact": "pending", "o": "-5"},
    "timers, search id": {"q": "123457"},
    "timers, search key prefix": {"q": "order:12345"},
    "timers, search target": {"q": "target:myapp.tasks.job7"},
    "timers, hand-written sort ignored": {"o": "5"},
}

RUN_PAGES = {
    "runs": {},
    "runs failed": {"state__exact": "failed"},
    "runs of one workflow": {"name": "testproject.demo.workflows.nap"},
    "runs, search id prefix": {"q": "run-00099"},
    "runs bound to an object": {"q": "demo.order:5000"},
    "steps of one run": {"run__id__exact": BUSY_RUN},
    "steps": {},
}


@pytest.mark.parametrize("label", list(TIMER_PAGES))
def test_timer_lists_use_indexes(big_tables, admin_client, label):
    check_page(admin_client, label, reverse("admin:durable_timer_changelist"), TIMER_PAGES[label])


@pytest.mark.parametrize("label", list(RUN_PAGES))
def test_workflow_lists_use_indexes(big_tables, admin_client, label):
    model = "workflowstep" if label.startswith("steps") else "workflowrun"
    url = reverse(f"admin:durable_{model}_changelist")
    check_page(admin_client, label, url, RUN_PAGES[label])


def test_detail_pages_are_cheap(big_tables, admin_client):
    timer_id = 123_457
    check_page(admin_client, "timer page", reverse("admin:durable_timer_change", args=[timer_id]))
    url = reverse("admin:durable_workflowrun_change", args=[BUSY_RUN])
    check_page(admin_client, "run page (300 steps, 50 shown)", url)


def test_unfiltered_count_is_the_planner_estimate(big_tables, admin_client):
    response = admin_client.get(reverse("admin:durable_timer_changelist"))
    cl = response.context["cl"]
    assert cl.paginator.estimated
    assert 0.8 * TIMERS < cl.result_count < 1.2 * TIMERS
    assert cl.paginator.num_pages == 100  # 10,000 rows' worth: no deep OFFSET
    assert "about " in response.content.decode()


def test_overview_counts_are_capped_and_use_indexes(big_tables, admin_client):
    # Leases for the 64 shards the timers are spread over, so the per-shard counts run
    # (about 14,000 pending timers each).
    from durable.models import ShardLease

    ShardLease.objects.bulk_create(ShardLease(shard=s, owner=f"w{s % 4}") for s in range(64))
    url = reverse("admin:durable_overview")
    queries, elapsed = fetch(admin_client, url)
    print(f"\noverview: {len(queries)} queries, {elapsed * 1000:.0f} ms")
    for sql in queries:
        if not on_big_table(sql):
            continue
        text = plan(sql)
        lines = text.splitlines()
        print(f"  {sql[:150]}\n    {lines[-1].strip()}; rows read {count_rows(text):,}")
        for table in BIG_TABLES:
            assert f"Seq Scan on {table}" not in text, (sql, text)
        if "COUNT(" in sql.upper():
            # Capped: no count reads more than the overview's budget of 10,000 rows,
            # plus one row per count to tell "capped" (64 per-shard ones here).
            assert count_rows(text) <= 10_000 + 64, ("unbounded count", sql, text)
    response = admin_client.get(url)
    assert response.context["pending_capped"]  # 14,000 a shard is past the cap
    assert response.context["pending"] <= 10_000
    assert elapsed < MAX_SECONDS
