"""Cost of the line keeper's scan (``durable.storage.lines.parked_keys``) on PostgreSQL.

    python bench/line_keys.py             # LINES_DB (default durable_lines), migrated

Inserts 200 keys x 500 parked timers (100,000 waiting in lines), 200,000 pending timers
of three of those keys due later (in no line: the scan must not read them) and 100,000
pending timers without a key; times the scan (5 rounds, after one to warm the cache),
prints the plan (every probe must be an index scan of ``durable_timer_line_idx``) and
the load average, and deletes the rows it inserted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import setup_django

URL = "postgres://durable:durable@127.0.0.1:5432/" + os.environ.get("LINES_DB", "durable_lines")

COLUMNS = (
    "kind, target, args, kwargs, state, fire_at_ms, bucket, shard, attempts, max_attempts, "
    "backoff_base_s, backoff_max_s, on_complete, last_error, created_at, updated_at, "
    "concurrency_key, queued_ms"
)
ROW = (
    "'handler', %s, '[]'::jsonb, '{}'::jsonb, 'pending', %s, 0, 0, 0, 5, 1, 60, '', '', "
    "now(), now()"
)


def main() -> None:
    setup_django(URL, DJANGO_DEBUG="false")
    from django.db import connection

    from durable.storage import lines
    from durable.storage.key_counts import PARKED_MS

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM durable_timer WHERE target LIKE 'bench.lines.%%'")
        cursor.execute(
            f"INSERT INTO durable_timer ({COLUMNS}) "
            f"SELECT {ROW}, 'bench.lines:' || (g %% 200), g FROM generate_series(1, 100000) g "
            f"UNION ALL SELECT {ROW}, 'bench.lines:' || (g %% 3), NULL "
            "FROM generate_series(1, 200000) g "
            f"UNION ALL SELECT {ROW}, NULL, NULL FROM generate_series(1, 100000) g",
            [
                *("bench.lines.parked", PARKED_MS),
                *("bench.lines.later", 1_902_000_000_000),
                *("bench.lines.plain", 1_900_000_000_000),
            ],
        )
        cursor.execute("ANALYZE durable_timer")
    try:
        lines.parked_keys("default")
        for round_ in range(5):
            started = time.perf_counter()
            keys = lines.parked_keys("default")
            ms = (time.perf_counter() - started) * 1000
            load = Path("/proc/loadavg").read_text().split()[0]
            print(f"round {round_}: {len(keys)} keys in {ms:.1f} ms (load {load})")
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF) " + lines.PARKED_KEYS_SQL, [PARKED_MS] * 3)
            print("\n".join(row[0] for row in cursor.fetchall()))
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM durable_timer WHERE target LIKE 'bench.lines.%%'")


if __name__ == "__main__":
    main()
