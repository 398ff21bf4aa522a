"""A deadline for atomic handlers, which run on the worker's loop thread.

An atomic handler runs inside the batch transaction, on the thread that also renews the
worker's leases; one that never returns would hold its shard (and every shard of its
batch) for good, and after the lease moved, hang the next worker the same way. The
loop thread is the process's main thread under ``run_timer_shards``, so the deadline is
a ``SIGALRM`` interval timer whose handler raises :class:`~durable.exceptions.
HandlerTimeout` in the handler's frame: a loop, a ``time.sleep`` or a blocking socket
read is interrupted there, the handler's savepoint rolls back, and the attempt counts as
failed.

Only while a handler runs does the alarm raise (:attr:`Deadlines.armed`), so an alarm
that fires just after the handler returned cannot hit the firer's own bookkeeping.
Off the main thread (tests that run an engine in a thread) there is no deadline.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from durable.exceptions import HandlerTimeout


class Deadlines:
    """Arms ``SIGALRM`` around atomic handler calls on the main thread."""

    def __init__(self) -> None:
        self.armed = False
        self._timeout_s = 0.0
        self._installed = False

    def _enabled(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        if not self._installed:
            signal.signal(signal.SIGALRM, self._on_alarm)
            self._installed = True
        return True

    def _on_alarm(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.armed = False
            raise HandlerTimeout(
                f"the handler ran past its timeout of {self._timeout_s:g} s and was interrupted",
                timeout_s=self._timeout_s,
            )

    @contextmanager
    def limit(self, timeout_s: float | None) -> Iterator[None]:
        """Interrupt the block with ``HandlerTimeout`` after ``timeout_s`` (None: no limit)."""
        if not timeout_s or not self._enabled():
            yield
            return
        self._timeout_s = timeout_s
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            yield
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
