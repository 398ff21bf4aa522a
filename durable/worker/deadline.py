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

import math
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from durable.exceptions import HandlerTimeout


class Deadlines:
    """Arms ``SIGALRM`` around atomic handler calls on the main thread.

    Whatever held ``SIGALRM`` before (pytest-timeout's signal method, say) gets its handler
    and its remaining time back after each call.
    """

    def __init__(self) -> None:
        self.armed = False
        self._timeout_s = 0.0

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
        if (
            not timeout_s
            or not math.isfinite(timeout_s)
            or threading.current_thread() is not threading.main_thread()
        ):
            yield
            return
        self._timeout_s = timeout_s
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        started = time.monotonic()
        self.armed = True
        pending, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            yield
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if pending:  # someone else's alarm: give it back what is left of it
                left = pending - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))
