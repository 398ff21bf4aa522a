"""DBOS Transact's scheduled workflows, for ``bench/schedules.py`` (run with DBOS's Python).

DBOS is not a dependency of durable: ``bench/schedules.py --dbos-python PATH`` runs this
file with an interpreter that has ``dbos`` installed (``pip install dbos`` in its own
virtualenv) and reads one JSON line from its stdout. Configuration is DBOS's defaults,
on its own database of the same PostgreSQL server:

    python bench/peers/dbos_cron_peer.py URL lateness SCHEDULES SECONDS
    python bench/peers/dbos_cron_peer.py URL memory SCHEDULES WINDOW_SECONDS

``lateness``: SCHEDULES schedules ``* * * * * *`` (every second); the workflow records
wall clock at its start minus its scheduled time. ``memory``: RSS before and after
creating SCHEDULES daily schedules (``m h * * *``, none due during the run), and how
many times the schedule table was scanned (``pg_stat_user_tables``) during a window.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime
from typing import Any

EVENTS: list[tuple[float, float]] = []


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def scans(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(seq_scan + coalesce(idx_scan, 0)), 0) FROM pg_stat_user_tables"
            " WHERE relname = 'workflow_schedules'"
        ).fetchone()
        return int(row[0]) if row else 0


def main() -> None:
    url, mode, count, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    from dbos import DBOS

    DBOS(config={"name": "bench_cron", "system_database_url": url, "log_level": "WARNING"})

    @DBOS.workflow()
    def tick(scheduled: datetime, context: Any) -> None:
        EVENTS.append((scheduled.timestamp() * 1000, time.time_ns() / 1e6))

    DBOS.launch()
    out: dict[str, Any] = {"threads_before": 0}
    if mode == "lateness":
        for i in range(count):
            DBOS.create_schedule(schedule_name=f"s{i}", workflow_fn=tick, schedule="* * * * * *")
        time.sleep(seconds)
        out["events"] = EVENTS[:]
    else:
        import threading

        time.sleep(3)
        before = rss_mb()
        out["threads_before"] = threading.active_count()
        for i in range(count):
            DBOS.create_schedule(
                schedule_name=f"d{i}",
                workflow_fn=tick,
                schedule=f"0 {i % 60} {(i // 60) % 24} * * *",
            )
        time.sleep(35)  # one default scheduler poll (30 s) starts a thread per schedule
        out["threads_after"] = threading.active_count()
        scanned = scans(url)
        time.sleep(seconds)
        out["scans_in_window"] = scans(url) - scanned
        out["rss_added_mb"] = rss_mb() - before
    print(json.dumps(out), flush=True)
    DBOS.destroy(destroy_registry=True)
    os._exit(0)  # schedule threads are daemons; do not wait for them


if __name__ == "__main__":
    main()
