"""The worker's handler threads: :class:`HandlerPool`, and the connection each one keeps.

External handlers (see :mod:`durable.worker.external`) and the worker's chores run on
these daemon threads. A thread stuck in a call can be replaced without waiting for it,
and :func:`tidy_connections` keeps a thread's database connection between calls, up to
:data:`CONNECTION_MAX_AGE_S`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from durable.workflows.deadline import keep_step_thread, stop_step_thread

log = logging.getLogger("durable.worker")


#: How long a handler thread keeps its database connection between handlers. Django's
#: ``close_old_connections`` (its request-boundary rule) closes it after every handler
#: with the default ``CONN_MAX_AGE`` of 0: a new PostgreSQL connection per external timer
#: made a worker's external handlers about three times slower (1,000 took 6.9 s instead
#: of 1.8 s with 16 threads). A handler thread is not a request; its connection is kept,
#: and replaced after this long so that a changed server (a failover) is picked up.
CONNECTION_MAX_AGE_S = 60.0


def tidy_connections() -> None:
    """After a handler, on its pool thread: keep this thread's connections for the next
    one, unless broken (an error and no longer usable) or older than
    :data:`CONNECTION_MAX_AGE_S`."""
    now = time.monotonic()
    for conn in connections.all(initialized_only=True):
        raw = conn.connection
        if raw is None:
            continue
        opened = getattr(conn, "_durable_opened", None)
        if opened is None or opened[0] is not raw:
            conn._durable_opened = opened = (raw, now)
        if conn.errors_occurred:
            if not conn.is_usable():
                conn.close()
                continue
            conn.errors_occurred = False
        if now - opened[1] > CONNECTION_MAX_AGE_S and not conn.in_atomic_block:
            conn.close()


class HandlerPool:
    """Daemon threads that run submitted calls; a stuck thread can be replaced.

    Daemon threads, so that a handler that never returns cannot keep the process from
    exiting once the worker has shut down (the executor of the standard library joins
    its threads at exit).
    """

    def __init__(self, threads: int, name: str = "durable") -> None:
        self.size = threads
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._retired: set[threading.Thread] = set()
        self._started = 0
        self._closed = False
        for _ in range(threads):
            self._spawn()

    def _spawn(self) -> None:
        self._started += 1
        thread = threading.Thread(
            target=self._work, name=f"{self.name}_{self._started}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread."""
        if self._closed:
            raise RuntimeError("the handler pool is shut down")
        self._jobs.put((fn, args))

    def replace(self, thread: threading.Thread) -> None:
        """Start a new thread in place of ``thread``, which is stuck in a call.

        ``thread`` leaves the pool when (if ever) its call returns.
        """
        with self._lock:
            if thread not in self._threads or self._closed:
                return
            self._threads.remove(thread)
            self._retired.add(thread)
            self._spawn()

    def _work(self) -> None:
        keep_step_thread()  # its replays' outside steps get a reusable step thread
        try:
            self._serve()
        finally:
            stop_step_thread()  # its replays' step thread, if any
            connections.close_all()  # the thread's own, kept between its calls

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except BaseException:  # the callers contain their own; this is the last net
                log.exception("handler pool: a call raised")
            with self._lock:
                if me in self._retired:
                    self._retired.discard(me)
                    return

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Stop taking calls; drop queued ones if ``cancel_futures``; join if ``wait``."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    self._jobs.get_nowait()
                except queue.Empty:
                    break
        for _ in threads:
            self._jobs.put(None)
        if wait:
            for thread in threads:
                thread.join()
