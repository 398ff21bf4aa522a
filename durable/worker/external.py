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
has free threads (:attr:`ExternalRunner.free`): the rest waits in the wheel. The pool
itself is :mod:`durable.worker.pool`.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError, connections, transaction

from durable.conf import DurableSettings
from durable.core.clock import Clock
from durable.dispatch import executors
from durable.dispatch.context import FireContext, firing
from durable.dispatch.registry import HandlerSpec
from durable.exceptions import HandlerTimeout, LeaseLost
from durable.metrics import WorkerMetrics
from durable.storage import firing as store
from durable.storage.leases import fence
from durable.worker import admission
from durable.worker.logs import event
from durable.worker.outcomes import Outcomes, Readd, json_value

# The pool and its connection rule are durable.worker.pool; engine.py imports them from here.
from durable.worker.pool import HandlerPool, tidy_connections

#: A completion that fails on a database error is retried on a new connection after this
#: pause, doubled each time up to the maximum (see ``ExternalRunner._complete_retrying``).
COMPLETE_RETRY_S = 0.25
COMPLETE_RETRY_MAX_S = 5.0

log = logging.getLogger("durable.worker")


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
        self.shift = conf.BUCKET_SHIFT
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
            self._complete_retrying(entry, value, error, readd)
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

    def _complete_retrying(
        self, entry: Running, value: Any, error: BaseException | None, readd: list[Readd]
    ) -> None:
        """:meth:`complete`, again on a new connection while the database is unreachable.

        A handler can leave its thread's connection broken (its session terminated, the
        server restarting): given up on, the claim would stay ``firing`` under a live
        owner until ``CLAIM_TIMEOUT_S``, so this retries with backoff for that long (past
        it, any owner re-runs the timer anyway). :meth:`complete` is safe to repeat: once
        an outcome committed the claim no longer stands, and a repeat does nothing.
        """
        give_up = time.monotonic() + self.conf.CLAIM_TIMEOUT_S
        pause = COMPLETE_RETRY_S
        while True:
            outcome: list[Readd] = []
            try:
                self.complete(entry, value, error, outcome)
            except (OperationalError, InterfaceError):
                # The connection, not the statement: a statement's own error (a bad
                # follow-up, say) would fail the same way again, so it is not retried.
                if time.monotonic() + pause > give_up:
                    raise
                connections[self.db].close()  # the next query opens a new one
                time.sleep(pause)
                pause = min(pause * 2, COMPLETE_RETRY_MAX_S)
                continue
            readd.extend(outcome)
            return

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
            # Its end frees a slot of its concurrency key: the next in line is made due.
            readd += admission.release(self.db, [(timer.id, entry.spec)], now_ms, self.shift)
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
