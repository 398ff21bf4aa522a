"""Deadlines for outside steps: the step runs on a helper thread the replay waits for.

A replay runs on one of the worker's handler threads, and Python cannot interrupt a
thread. So an outside step (``ctx.step``) with a deadline runs on a *step thread* kept
for the calling thread, and the replay waits for it at most that long: past it, the
attempt fails with :class:`~durable.exceptions.HandlerTimeout` (retried like any step
failure) and the step thread is abandoned to its call, which finishes (or not) on its
own; the next step gets a fresh one. The step thread is reused between steps (a handoff,
not a thread start, per step) and keeps its database connection between them, as the
handler threads do. Context variables (``durable.current_fire()``) are those of the
replay at the call.

The step does not run on the replay's database connection; an outside step is outside
any transaction anyway. ``ctx.atomic`` steps run in the replay's own transaction and have
no deadline.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any

from django.db import connections

from durable.exceptions import HandlerTimeout

Job = tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class StepThread:
    """One daemon thread running the steps of one replay thread, one at a time."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Job, dict[str, Any], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self.abandoned = False
        self._thread = threading.Thread(target=self._serve, name="durable-step", daemon=True)
        self._thread.start()

    def call(self, job: Job, timeout_s: float) -> Any:
        """Run ``job`` there; its value, its exception, or ``HandlerTimeout`` past the
        deadline (then this thread is abandoned)."""
        box: dict[str, Any] = {}
        done = threading.Event()
        self._jobs.put((job, box, done))
        if not done.wait(timeout_s):
            self.abandoned = True
            raise HandlerTimeout(
                f"the step ran past its timeout of {timeout_s:g} s and was abandoned",
                timeout_s=timeout_s,
            )
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stop(self, wait_s: float = 5.0) -> None:
        """End the thread (it is idle: its caller is not waiting on it) and its
        connections; wait for that up to ``wait_s``."""
        self._jobs.put(None)
        self._thread.join(wait_s)

    def _serve(self) -> None:
        try:
            while not self.abandoned:
                item = self._jobs.get()
                if item is None:
                    return
                (context, fn, args, kwargs), box, done = item
                try:
                    box["value"] = context.run(fn, *args, **kwargs)
                except BaseException as exc:  # the replay records it as the step's failure
                    box["error"] = exc
                finally:
                    _drop_broken_connections()
                    done.set()
        finally:
            connections.close_all()  # this thread's own


def _drop_broken_connections() -> None:
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None and conn.errors_occurred:
            if conn.is_usable():
                conn.errors_occurred = False
            else:
                conn.close()


_local = threading.local()


def keep_step_thread() -> None:
    """Let this thread keep a step thread between steps (the worker's handler threads,
    which end it with :func:`stop_step_thread`)."""
    _local.keeps = True


def keeps_step_thread() -> bool:
    """Whether this thread is one of the worker's handler threads."""
    return bool(getattr(_local, "keeps", False))


def call_with_deadline(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout_s: float
) -> Any:
    """``fn(*args, **kwargs)`` on a step thread; ``HandlerTimeout`` if it has not returned
    within ``timeout_s`` (the late call is left to finish on its own). A handler thread
    keeps its step thread; any other caller gets one for this call only."""
    job = (contextvars.copy_context(), fn, args, kwargs)
    if not keeps_step_thread():
        helper = StepThread()
        try:
            return helper.call(job, timeout_s)
        finally:
            if not helper.abandoned:
                helper.stop()
    kept: StepThread | None = getattr(_local, "helper", None)
    if kept is None or kept.abandoned:
        kept = _local.helper = StepThread()
    return kept.call(job, timeout_s)


def stop_step_thread() -> None:
    """End this thread's step thread, if any (a handler thread that exits calls it)."""
    helper: StepThread | None = getattr(_local, "helper", None)
    _local.helper = None
    if helper is not None and not helper.abandoned:
        helper.stop()
