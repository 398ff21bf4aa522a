"""External handlers: run on the worker's handler threads, outside any batch transaction.

A timer whose handler is not atomic (``atomic=False`` handlers, Django tasks, Celery
publishes, workflow replays, and with ``DISPATCH = "kombu"`` every shipped timer) is
claimed in the batch transaction, with its attempt already counted
(:mod:`durable.storage.claims`), and handed to :class:`ExternalRunner` once that commits.
The runner calls it on a :class:`HandlerPool` thread and completes it in a fenced
transaction of its own (or the handler completed it in its own last one:
:func:`durable.storage.firing.complete_claim`).

Poison is contained here as in the batch: a handler that raises anything, a
``BaseException`` included, fails that one attempt; one that runs past its deadline
(``timeout=`` of the handler, else ``HANDLER_TIMEOUT_S``) is abandoned by
:meth:`ExternalRunner.reap`, which records the failed attempt, puts a fresh thread in
the pool in place of the stuck one, and lets the stuck one's late completion fall on a
claim that no longer stands. The firer never claims more external work than the pool
has free threads (:attr:`ExternalRunner.free`): the rest waits in the wheel.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction

from durable.conf import DurableSettings
from durable.core.clock import Clock
from durable.dispatch import executors
from durable.dispatch.context import FireContext, firing
from durable.dispatch.registry import HandlerSpec
from durable.exceptions import HandlerTimeout, LeaseLost
from durable.metrics import WorkerMetrics
from durable.storage import firing as store
from durable.storage.leases import fence
from durable.worker.logs import event
from durable.worker.outcomes import Outcomes, Readd, json_value
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


@dataclass(slots=True, eq=False)
class Running:
    """One external attempt on its way: submitted, running, or abandoned."""

    timer: store.DueTimer
    shard: int
    token: int
    spec: HandlerSpec
    deadline_ms: float
    """The worker's clock reading past which :meth:`ExternalRunner.reap` abandons it."""
    thread: threading.Thread | None = None
    returned: bool = False
    """The handler returned (its completion may still be committing)."""
    abandoned: bool = False

    @property
    def attempt(self) -> int:
        """The attempt number, counted before the claim."""
        return self.timer.attempts


class ExternalRunner:
    """Runs claimed external timers on a :class:`HandlerPool`; see the module docstring."""

    def __init__(
        self,
        *,
        db: str,
        conf: DurableSettings,
        clock: Clock,
        pool: HandlerPool,
        inbox: queue.SimpleQueue[Readd],
        outcomes: Outcomes,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.db = db
        self.conf = conf
        self.clock = clock
        self.pool = pool
        self.inbox = inbox
        self.outcomes = outcomes
        self.metrics = metrics
        # DISPATCH = "kombu": these kinds are claimed and shipped to executor processes.
        self.shipped = executors.SHIPPED_KINDS if conf.DISPATCH == "kombu" else frozenset()
        self._lock = threading.Lock()
        self._running: dict[int, Running] = {}
        self._parked: dict[int, Readd] = {}  # waiting for a free thread, oldest first
        self.freed = threading.Event()
        """Set whenever an attempt is done: the loop waits on it while timers are parked."""

    @property
    def in_flight(self) -> int:
        """External attempts submitted and not yet completed (abandoned ones excluded)."""
        with self._lock:
            return len(self._running)

    @property
    def free(self) -> int:
        """How many more external timers the pool can take now."""
        return max(0, self.pool.size - self.in_flight)

    @property
    def parked(self) -> int:
        """External timers due and waiting for a free thread."""
        return len(self._parked)

    def park(self, shard: int, timer_id: int, fire_at_ms: int) -> None:
        """Keep a due external timer out of the wheel until a thread is free (the engine
        waits for :attr:`freed`, then takes it back with :meth:`unpark`; no database work
        meanwhile)."""
        self._parked.setdefault(timer_id, (shard, timer_id, fire_at_ms))

    def unpark(self) -> list[Readd]:
        """As many parked timers as there are free threads, oldest first (loop thread)."""
        take = min(self.free, len(self._parked))
        ids = list(self._parked)[:take]
        return [self._parked.pop(timer_id) for timer_id in ids]

    def timeout_s(self, spec: HandlerSpec) -> float:
        """The handler's deadline: its own ``timeout``, else ``HANDLER_TIMEOUT_S``; never
        past ``CLAIM_TIMEOUT_S``, after which its claim would run it again."""
        if spec.timeout == math.inf:
            return math.inf  # no deadline (workflow replays: the claim covers them)
        timeout = spec.timeout if spec.timeout is not None else self.conf.HANDLER_TIMEOUT_S
        return min(timeout, self.conf.CLAIM_TIMEOUT_S)

    def submit(self, shard: int, token: int, timer: store.DueTimer, spec: HandlerSpec) -> None:
        """Run one claimed timer (its claim committed) on a pool thread."""
        timeout = self.timeout_s(spec)
        deadline = self.clock.now_ms() + timeout * 1000 if math.isfinite(timeout) else math.inf
        entry = Running(timer=timer, shard=shard, token=token, spec=spec, deadline_ms=deadline)
        with self._lock:
            self._running[timer.id] = entry
        run = self._ship if timer.kind in self.shipped else self._run
        self.pool.submit(run, entry)

    # -- on a pool thread ---------------------------------------------------------------

    def _run(self, entry: Running) -> None:
        try:
            self._call(entry)
        finally:
            tidy_connections()  # this pool thread's, never the loop's

    def _call(self, entry: Running) -> None:
        entry.thread = threading.current_thread()
        timer = entry.timer
        ctx = FireContext(
            timer_id=timer.id,
            key=timer.key,
            attempt=entry.attempt,
            scheduled_ms=timer.fire_at_ms,
            fired_ms=self.clock.now_ms(),
            shard=timer.shard,
            token=entry.token,
            metrics=self.metrics,
        )
        value: Any = None
        error: BaseException | None = None
        try:
            with firing(ctx):
                value = entry.spec.fn(*timer.args, **timer.kwargs)
        # SystemExit, KeyboardInterrupt...: this attempt fails (HandlerAborted); GiveUp or
        # the handler's give_up_on/retry_on make the failure final.
        except BaseException as exc:
            error = entry.spec.failure(exc)
        if not self._finish(entry):
            return  # abandoned meanwhile: reap() recorded the attempt
        if error is None and ctx.completed and not timer.on_complete:
            self._done(entry)  # the handler's last transaction marked the timer fired
            return
        self._settle(entry, value, error)

    def _ship(self, entry: Running) -> None:
        """Send a claimed timer to the executors; a failed publish is a failed attempt."""
        entry.thread = threading.current_thread()
        timer = entry.timer
        shipment = executors.Shipment(
            timer_id=timer.id, attempt=entry.attempt, shard=entry.shard, token=entry.token
        )
        error: BaseException | None = None
        try:
            executors.ship(shipment, self.conf.BROKER_URL)
        except Exception as exc:  # broker down: retried with backoff, never lost
            error = exc
        try:
            if self._finish(entry):
                if error is None:
                    self._done(entry)
                else:
                    self._settle(entry, None, error)
        finally:
            tidy_connections()

    def _finish(self, entry: Running) -> bool:
        """Mark ``entry``'s handler returned (no reaping now); False if it was abandoned."""
        with self._lock:
            entry.returned = True
            return not entry.abandoned

    def _done(self, entry: Running) -> None:
        with self._lock:
            if self._running.get(entry.timer.id) is entry:
                del self._running[entry.timer.id]
        self.freed.set()

    def _settle(self, entry: Running, value: Any, error: BaseException | None) -> None:
        readd: list[Readd] = []
        try:
            self.complete(entry, value, error, readd)
        except LeaseLost as exc:
            event(
                log,
                logging.WARNING,
                "timer.complete_fenced",
                timer=entry.timer.id,
                shard=entry.shard,
                reason=str(exc),
            )
        except Exception:
            log.exception("completing external timer %s failed", entry.timer.id)
        finally:
            for item in readd:
                self.inbox.put(item)
            self._done(entry)

    # -- completion (pool thread or the loop's watchdog) ----------------------------------

    def complete(
        self, entry: Running, value: Any, error: BaseException | None, readd: list[Readd]
    ) -> None:
        """Record the attempt's outcome, fenced, if our claim (that attempt) still stands."""
        timer, attempt = entry.timer, entry.attempt
        now_ms = self.clock.now_ms()
        with transaction.atomic(using=self.db):
            fence(self.db, entry.shard, entry.token)
            if not store.still_claimed(self.db, timer.id, attempt):
                return  # cancelled, or re-run under a newer claim
            if error is not None:
                self.outcomes.retry_or_fail(timer, attempt, entry.token, error, now_ms, readd)
            else:
                result = (
                    json_value(value, self.conf.MAX_RESULT_BYTES) if timer.on_complete else None
                )
                results = {timer.id: result} if result else None
                store.mark_fired(self.db, [timer.id], {entry.shard: entry.token}, now_ms, results)
                if timer.on_complete:
                    success = {"status": "success", "value": result}
                    self.outcomes.followup(timer, success, now_ms, readd)
        if error is not None:
            self.outcomes.log_error(timer, attempt, error)

    def reap(self) -> int:
        """Abandon attempts past their deadline: record each as failed; return how many.

        Called from the engine's loop. The stuck thread is replaced in the pool; when its
        handler returns at last, its completion finds the claim gone and does nothing.
        """
        now = self.clock.now_ms()
        with self._lock:
            late = [e for e in self._running.values() if e.deadline_ms <= now and not e.returned]
            for entry in late:
                entry.abandoned = True
        for entry in late:
            if entry.thread is not None:
                self.pool.replace(entry.thread)
            timeout = self.timeout_s(entry.spec)
            event(
                log,
                logging.ERROR,
                "timer.timeout",
                timer=entry.timer.id,
                target=entry.timer.target,
                attempt=entry.attempt,
                timeout_s=timeout,
            )
            error = HandlerTimeout(
                f"the handler ran past its timeout of {timeout:g} s and was abandoned",
                timeout_s=timeout,
            )
            self._settle(entry, None, entry.spec.failure(error))
        return len(late)
