"""A tiny Celery app for tests, the benchmark and the chaos run: a stock Celery worker.

Start it with ``celery -A testproject.celery_app worker``. It does not load Django: its
task appends one JSON line per execution to a file in ``CELERY_OUT_DIR``, so tests can
count executions (and spot duplicates) without a database in the Celery worker.

Environment: ``CELERY_BROKER_URL`` (default ``redis://127.0.0.1:6379/0``) and
``CELERY_OUT_DIR`` (default the current directory).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from celery import Celery

app = Celery("testproject", broker=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    # JSON only, the same as durable publishes: never pickle.
    task_serializer="json",
    accept_content=["json"],
    result_backend=None,
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    # Counting executions must not depend on prefetched messages: ack after running.
    task_acks_late=True,
    worker_prefetch_multiplier=4,
)

OUT_FILE = "executions.jsonl"


def out_path() -> Path:
    """The file the ``record`` task appends to."""
    return Path(os.environ.get("CELERY_OUT_DIR", ".")) / OUT_FILE


@app.task(name="testproject.record", bind=True)
def record(self: Any, key: str, due_ms: int | None = None, **extra: Any) -> str:
    """Append ``{key, task_id, due_ms, ran_ms, extra}`` to the executions file."""
    line = {
        "key": key,
        "task_id": self.request.id,
        "due_ms": due_ms,
        "eta": self.request.eta,
        "ran_ms": time.time_ns() // 1_000_000,
        "extra": extra,
    }
    # One write of one line with O_APPEND: concurrent worker processes never interleave.
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(out_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return key


def read_executions(directory: Path) -> list[dict[str, Any]]:
    """Every line the ``record`` task wrote in ``directory``."""
    path = directory / OUT_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
