"""Waiting in tests for what another thread or process does (a handler on a pool thread,
a worker subprocess): poll a predicate until it holds or a timeout passes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    predicate: Callable[[], object], timeout_s: float = 10.0, every_s: float = 0.02
) -> bool:
    """True once ``predicate()`` is true, polled every ``every_s``; after ``timeout_s``,
    whatever one last call says."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every_s)
    return bool(predicate())
