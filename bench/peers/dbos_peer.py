"""DBOS Transact on the same PostgreSQL: the workflow benchmark's peer (own venv, own process).

Run by ``bench/workflows.py --dbos PYTHON`` with a Python that has ``dbos`` installed (it
is not a dependency of durable)::

    python -m venv /tmp/dbosenv && /tmp/dbosenv/bin/pip install dbos
    /tmp/dbosenv/bin/python bench/peers/dbos_peer.py URL N_SEQ N_CONC N_START N_SLEEP

Prints one JSON object: the same figures as durable's sections, measured the way DBOS
is used: a workflow of ten ``@DBOS.step`` steps called directly (sequential) and from 8
threads (concurrent), ``DBOS.start_workflow`` in a loop (start rate), and sleepers started
with ``DBOS.start_workflow`` sleeping with ``DBOS.sleep`` (threads and RSS held).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dbos import DBOS, DBOSConfig

URL, N_SEQ, N_CONC, N_START, N_SLEEP = sys.argv[1], *map(int, sys.argv[2:6])
DBOS(config=DBOSConfig(name="durable-bench", system_database_url=URL, log_level="WARNING"))


@DBOS.step()
def increment(value: int) -> int:
    return value + 1


@DBOS.workflow()
def ten_steps(start: int) -> int:
    value = start
    for _ in range(10):
        value = increment(value)
    return value


WOKE: list[float] = []


@DBOS.workflow()
def nap(due_ms: float) -> None:
    DBOS.sleep(max(0.0, (due_ms - time.time() * 1000) / 1000))
    WOKE.append(time.time() * 1000 - due_ms)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    DBOS.launch()
    out: dict[str, float] = {}
    ten_steps(0)  # warm up
    started = time.perf_counter()
    for i in range(N_SEQ):
        ten_steps(i)
    took = time.perf_counter() - started
    out["seq_wf_s"] = N_SEQ / took
    with ThreadPoolExecutor(8) as pool:
        started = time.perf_counter()
        list(pool.map(ten_steps, range(N_CONC)))
        took = time.perf_counter() - started
    out["conc_wf_s"] = N_CONC / took
    handles = []
    started = time.perf_counter()
    for i in range(N_START):
        handles.append(DBOS.start_workflow(ten_steps, i))
    out["start_per_s"] = N_START / (time.perf_counter() - started)
    for handle in handles:
        handle.get_result()
    if N_SLEEP:
        base_rss, base_threads = rss_mb(), threading.active_count()
        # Open the wake window once every start is surely done (starts are not free).
        due0 = time.time() * 1000 + 2000 + 1500 * N_SLEEP / out["start_per_s"]
        naps = [DBOS.start_workflow(nap, due0 + random.uniform(1000, 5000)) for _ in range(N_SLEEP)]
        time.sleep(max(0.0, (due0 - 500) / 1000 - time.time()))
        out["sleep_threads_added"] = threading.active_count() - base_threads
        out["sleep_rss_added_mb"] = rss_mb() - base_rss
        for handle in naps:
            handle.get_result()
        ordered = sorted(WOKE)
        out["sleep_p50_ms"] = ordered[len(ordered) // 2]
        out["sleep_p99_ms"] = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(json.dumps(out), flush=True)
    DBOS.destroy()
    os._exit(0)


if __name__ == "__main__":
    main()
