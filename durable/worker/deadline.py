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

    A batch installs the signal handler once (:meth:`batch`) and each handler call only
    notes its deadline (:meth:`start`, :meth:`stop`): at thousands of fires a second,
    installing the handler and setting the interval timer twice per call were 5.5% of
    the fire loop (docs/benchmarks.md, issue 16). The interval timer is set only when it
    would ring later than the running call's deadline; when it rings early (it was set
    for an earlier call), it is set again for what is left of the running call's time,
    so a call is interrupted at its own deadline as before. Whatever held ``SIGALRM``
    before (pytest-timeout's signal method, say) gets its handler and its remaining time
    back when the batch ends.
    """

    def __init__(self) -> None:
        self.armed = False
        self._timeout_s = 0.0
        self._deadline = 0.0
        self._alarm_at: float | None = None
        self._active = False

    def _on_alarm(self, signum: int, frame: Any) -> None:
        self._alarm_at = None
        if not self.armed:
            return
        left = self._deadline - time.monotonic()
        if left > 0:  # set for an earlier call: ring at this one's deadline
            self._alarm_at = self._deadline
            signal.setitimer(signal.ITIMER_REAL, left)
            return
        self.armed = False
        raise HandlerTimeout(
            f"the handler ran past its timeout of {self._timeout_s:g} s and was interrupted",
            timeout_s=self._timeout_s,
        )

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold ``SIGALRM`` for the calls of one batch (main thread only; else a no-op)."""
        if self._active or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGALRM, self._on_alarm)
        started = time.monotonic()
        pending, _ = signal.setitimer(signal.ITIMER_REAL, 0)
        self._active = True
        self._alarm_at = None
        try:
            yield
        finally:
            self.armed = False
            self._active = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            self._alarm_at = None
            signal.signal(signal.SIGALRM, previous)
            if pending:  # someone else's alarm: give it back what is left of it
                left = pending - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))

    def start(self, timeout_s: float | None) -> None:
        """A call starts: interrupt it with ``HandlerTimeout`` after ``timeout_s`` (None,
        zero or infinite: no limit). Only inside :meth:`batch` on the main thread."""
        if not self._active or not timeout_s or not math.isfinite(timeout_s):
            return
        self._timeout_s = timeout_s
        self._deadline = deadline = time.monotonic() + timeout_s
        self.armed = True  # before the timer is looked at: an alarm now re-arms itself
        alarm_at = self._alarm_at
        if alarm_at is None or alarm_at > deadline:
            self._alarm_at = deadline
            signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 1e-6))

    def stop(self) -> None:
        """The call returned (or raised): an alarm from now on interrupts nothing."""
        self.armed = False

    @contextmanager
    def limit(self, timeout_s: float | None) -> Iterator[None]:
        """Interrupt the block with ``HandlerTimeout`` after ``timeout_s`` (None: no limit)."""
        with self.batch():
            self.start(timeout_s)
            try:
                yield
            finally:
                self.stop()
