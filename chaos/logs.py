"""What the workers' logs tell the chaos checker: loop holds, failed attempts, publishes.

Read by :func:`chaos.run.check_and_report` from the run's ``worker-*.log`` files; the
parsing of holds and retries is in :mod:`chaos.lateness` (pure).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

#: A worker's log line for a Celery message the broker took (durable.dispatch.celery).
PUBLISHED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ \S+ celery\.published timer=(\d+) "
)


def loop_holds(out: Path) -> list[dict[str, Any]]:
    """Every hold of a worker's loop by an atomic handler past its timeout, and every span
    in which hanging external handlers held all of a worker's handler threads, from the
    logs."""
    import testproject.demo.chaos  # noqa: F401  (the workers' DURABLE_IMPORTS)
    from chaos.lateness import Bounds, holds_from_logs, thread_holds_from_logs
    from durable.conf import get_settings
    from durable.discovery import discover
    from durable.dispatch.registry import handlers

    discover(get_settings())  # the handlers the workers found, to tell atomic ones
    atomic = {name for name in handlers.names() if (spec := handlers.get(name)) and spec.atomic}
    holds: list[dict[str, Any]] = []
    for path in sorted(out.glob("worker-*.log")):
        worker = path.stem.removeprefix("worker-")
        with path.open(errors="replace") as lines:
            holds += holds_from_logs(lines, worker, atomic)
        with path.open(errors="replace") as lines:  # the workers run the default --threads
            holds += thread_holds_from_logs(lines, worker, Bounds().handler_threads)
    return holds


def retries(out: Path) -> dict[int, list[tuple[int, int]]]:
    """Timer id → ``(failed, retry due)`` of each failed attempt, from the worker logs."""
    from chaos.lateness import retries_from_logs

    found: dict[int, list[tuple[int, int]]] = {}
    for path in sorted(out.glob("worker-*.log")):
        with path.open(errors="replace") as lines:
            for timer_id, failures in retries_from_logs(lines).items():
                found.setdefault(timer_id, []).extend(failures)
    return found


def published(out: Path) -> dict[int, list[int]]:
    """Timer id → when the broker took each of its Celery messages (epoch ms, the
    worker's log time: this machine's local time, like the run's clock)."""
    found: dict[int, list[int]] = {}
    for path in sorted(out.glob("worker-*.log")):
        with path.open(errors="replace") as lines:
            for line in lines:
                match = PUBLISHED.match(line)
                if match:
                    stamp, millis, timer_id = match.groups()
                    at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
                    found.setdefault(int(timer_id), []).append(int(at * 1000) + int(millis))
    return found
