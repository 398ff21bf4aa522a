"""Fire due timers: one fenced transaction per batch.

A batch holds up to ``BATCH_SIZE`` due timers of one or more shards; its transaction
first fences every shard in it (:func:`durable.storage.leases.fence_shards`), so each
row commits fired under its own shard's valid token or not at all.

Atomic handlers run inside the batch transaction that marks them fired, so their effect
on the app's database happens exactly once. The fast path runs a batch without savepoints
(a savepoint per handler is two extra round trips and, past 64 per transaction, a
PostgreSQL subtransaction overflow); if any handler raises, the whole batch rolls back and
runs again with a savepoint per handler, so the failing handler rolls back only its own
effects and records its retry (the failing handler itself is not called again). Atomic
handlers must therefore keep their effects inside the database: the handlers that ran
before the failure in that batch are called twice, and commit once.

External handlers (``atomic=False``) are claimed in the batch transaction, run on the
executor after commit, and completed in a second fenced transaction (or in their own
last one: :func:`durable.storage.firing.complete_claim`); a crash in between leaves the
claim to expire, and the timer runs again (at least once).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from django.db import close_old_connections, transaction

from durable.conf import DurableSettings
from durable.core.backoff import Backoff
from durable.core.clock import Clock
from durable.core.errors import sanitize_error
from durable.dispatch import executors, kinds
from durable.dispatch.broker import DeferredPublishError, publishers
from durable.dispatch.context import FireContext, firing
from durable.dispatch.registry import HandlerRegistry, HandlerSpec
from durable.exceptions import LeaseLost
from durable.metrics import WorkerMetrics
from durable.storage import firing as store
from durable.storage.leases import fence
from durable.storage.notify import Announced, collecting
from durable.worker.logs import event
from durable.worker.runner import ShardRunner

log = logging.getLogger("durable.worker")

#: (shard, timer id, fire_at_ms) to put back in a wheel, from any thread.
Readd = tuple[int, int, int]


#: One batch of work: owned shards' runners, each with some of its due ids.
Work = Sequence[tuple[ShardRunner, Sequence[int]]]


class _Rollback(Exception):
    """A handler raised on the fast path: roll the batch back and redo it carefully."""

    def __init__(self, timer_id: int, error: Exception) -> None:
        super().__init__(timer_id, error)
        self.timer_id = timer_id
        self.error = error


class _Fenced(Exception):
    """Some shards of the batch are no longer ours: roll back, redo without them."""

    def __init__(self, stale: dict[int, int | None]) -> None:
        super().__init__(stale)
        self.stale = stale


@dataclass(slots=True)
class BatchOutcome:
    """What one batch did in one shard; the engine turns it into metrics and wheel updates."""

    fired: list[tuple[store.DueTimer, Any]] = field(default_factory=list)
    errors: list[tuple[store.DueTimer, BaseException]] = field(default_factory=list)
    external: list[store.DueTimer] = field(default_factory=list)
    leftover: list[store.DueTimer] = field(default_factory=list)
    readd: list[Readd] = field(default_factory=list)
    lateness_ms: list[int] = field(default_factory=list)
    lost: str = ""
    """Why the shard's lease was found lost (nothing fired), or empty."""


class Firer:
    """Runs batches of due timers for the engine's shard runners."""

    def __init__(
        self,
        *,
        db: str,
        conf: DurableSettings,
        clock: Clock,
        registry: HandlerRegistry,
        executor: Executor,
        inbox: queue.SimpleQueue[Readd],
        resolvers: dict[str, Callable[[str], HandlerSpec]] | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.db = db
        self.conf = conf
        self.clock = clock
        self.executor = executor
        self.inbox = inbox
        self.resolvers = {"handler": registry.resolve, **(resolvers or {})}
        self.metrics = metrics
        self._in_flight = 0  # external handlers submitted and not completed
        # DISPATCH = "kombu": these kinds are claimed and shipped to executor processes.
        self.shipped = executors.SHIPPED_KINDS if conf.DISPATCH == "kombu" else frozenset()
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """External handlers submitted to the executor and not yet completed."""
        with self._lock:
            return self._in_flight

    # -- batches -------------------------------------------------------------------------

    def fire(self, work: Work) -> dict[int, BatchOutcome]:
        """Fire one batch: due ids of one or more shards, in one fenced transaction.

        Firing the due timers of many shards together is what keeps lateness low at a
        steady rate: with 64 shards, a turn finds a timer or two in most of them, and a
        transaction per shard would pay a commit (a WAL flush) for each. Keep a batch to
        ``BATCH_SIZE`` ids in all (see :func:`pack`). Returns an outcome per shard; a
        shard whose lease was lost gets one with ``lost`` set (nothing of it fired), and
        the other shards of the batch still fire.
        """
        work = [(runner, ids) for runner, ids in work if ids]
        lost: dict[int, str] = {}
        outcomes: dict[int, BatchOutcome] = {}
        while work:
            try:
                try:
                    outcomes, announced = self._batch(work)
                except _Rollback as failed:
                    # The careful redo records the known failure without calling that
                    # handler again; those before it run again (first effects rolled back).
                    outcomes, announced = self._batch(work, failed={failed.timer_id: failed.error})
                except DeferredPublishError as exc:
                    # Some messages may have gone out: the careful redo sends them again
                    # (at least once; the task ids are the same).
                    event(log, logging.WARNING, "batch.publish_failed", error=str(exc))
                    outcomes, announced = self._batch(work, failed={})
                except kinds.RedoCarefully:
                    outcomes, announced = self._batch(work, failed={})
            except _Fenced as fenced:
                for shard, current in fenced.stale.items():
                    lost[shard] = f"lease of shard {shard} lost: token is stale (now {current})"
                work = [(runner, ids) for runner, ids in work if runner.shard not in lost]
                continue
            self._after_commit({runner.shard: runner for runner, _ in work}, outcomes, announced)
            break
        return outcomes | {shard: BatchOutcome(lost=why) for shard, why in lost.items()}

    def _batch(
        self, work: Work, *, failed: dict[int, Exception] | None = None
    ) -> tuple[dict[int, BatchOutcome], Announced]:
        """One fenced transaction. ``failed`` set means careful mode: a savepoint per handler."""
        runners = {runner.shard: runner for runner, _ in work}
        outcomes = {shard: BatchOutcome() for shard in runners}
        ids = [timer_id for _, chunk in work for timer_id in chunk]
        now_ms = self.clock.now_ms()
        deadline = time.monotonic() + self.conf.BATCH_TIME_BUDGET_S
        with transaction.atomic(using=self.db), collecting() as announced:
            tokens = {shard: runner.token for shard, runner in runners.items()}
            stale, due = store.fence_and_lock_due(self.db, tokens, ids, now_ms)
            if stale:
                raise _Fenced(stale)
            # Fast path: broker publishes (Celery timers) are held and sent in one flush
            # before the commit, and kinds do their batch-wide work once (cron locks all
            # its schedule rows in one read); the careful redo goes one timer at a time,
            # so that a failure is pinned on its own timer.
            fast = failed is None
            batch = kinds.FiringBatch(
                now_ms=now_ms, claim_until_ms=now_ms + int(self.conf.CLAIM_TIMEOUT_S * 1000)
            )
            with (
                publishers.deferred() if fast else contextlib.nullcontext(),
                kinds.batch_scopes(self.db, due, batch) if fast else contextlib.nullcontext(),
            ):
                for timer in due:
                    out = outcomes[timer.shard]
                    if time.monotonic() > deadline:
                        out.leftover.append(timer)  # budget spent: next batch takes it
                        continue
                    out.lateness_ms.append(now_ms - timer.fire_at_ms)
                    self._run_one(timer, now_ms, runners[timer.shard].token, failed, out)
                # A batch that only claimed commits asynchronously (see store.claim).
                batch.only_claims = not any(o.fired or o.errors for o in outcomes.values())
            self._record(runners, outcomes, batch)
        return outcomes, announced

    def _run_one(
        self,
        timer: store.DueTimer,
        now_ms: int,
        token: int,
        failed: dict[int, Exception] | None,
        out: BatchOutcome,
    ) -> None:
        try:
            spec = self._resolve(timer)
        except Exception as exc:  # unknown handler, unknown kind: retried, then dead letter
            out.errors.append((timer, exc))
            return
        if not spec.atomic or timer.kind in self.shipped:
            out.external.append(timer)
            return
        ctx = _context(timer, timer.attempts + 1, now_ms, token, self.metrics)
        if failed is None:
            try:
                with firing(ctx):
                    out.fired.append((timer, spec.fn(*timer.args, **timer.kwargs)))
            except kinds.RedoCarefully:
                raise
            except Exception as exc:
                raise _Rollback(timer.id, exc) from exc
            return
        if timer.id in failed:
            out.errors.append((timer, failed[timer.id]))
            return
        try:
            with transaction.atomic(using=self.db), firing(ctx):
                out.fired.append((timer, spec.fn(*timer.args, **timer.kwargs)))
        except Exception as exc:
            out.errors.append((timer, exc))

    def _record(
        self,
        runners: dict[int, ShardRunner],
        outcomes: dict[int, BatchOutcome],
        batch: kinds.FiringBatch,
    ) -> None:
        now_ms = batch.now_ms
        fired = [pair for out in outcomes.values() for pair in out.fired]
        results = {t.id: _json_value(v) for t, v in fired if t.on_complete}
        tokens = {shard: runner.token for shard, runner in runners.items()}
        # fired_at is when the batch's handlers were done (and its publishes flushed),
        # not when it started: the row then says when the fire took effect.
        done_ms = self.clock.now_ms()
        store.mark_fired(self.db, [t.id for t, _ in fired], tokens, done_ms, results)
        external: list[int] = []
        for shard, out in outcomes.items():
            for timer, _ in out.fired:
                if timer.on_complete:
                    self._followup(
                        timer, {"status": "success", "value": results[timer.id]}, now_ms, out
                    )
            for timer, exc in out.errors:
                token = runners[shard].token
                self._retry_or_fail(timer, timer.attempts + 1, token, exc, now_ms, out.readd)
            external.extend(t.id for t in out.external if t.id not in batch.claimed)
        if external:
            store.claim(self.db, external, batch.claim_until_ms, durable=not batch.only_claims)

    def _after_commit(
        self,
        by_shard: dict[int, ShardRunner],
        outcomes: dict[int, BatchOutcome],
        announced: Announced,
    ) -> None:
        # Timers the batch scheduled (follow-ups, retries, next occurrences) enter their
        # wheel now; those of shards not in this batch go through the engine's inbox.
        readd = [item for out in outcomes.values() for item in out.readd] + announced
        for shard, timer_id, fire_at in readd:
            runner = by_shard.get(shard)
            if runner is not None:
                runner.add(timer_id, fire_at)
            else:
                self.inbox.put((shard, timer_id, fire_at))
        for shard, out in outcomes.items():
            runner = by_shard[shard]
            for timer in out.leftover:
                runner.add(timer.id, timer.fire_at_ms)
            for timer in out.external:
                with self._lock:
                    self._in_flight += 1
                run = self._ship if timer.kind in self.shipped else self._run_external
                self.executor.submit(run, shard, runner.token, timer)
            for timer, exc in out.errors:
                event(
                    log,
                    logging.WARNING,
                    "timer.error",
                    timer=timer.id,
                    target=timer.target,
                    attempt=timer.attempts + 1,
                    error=sanitize_error(exc),
                )

    # -- retries and follow-ups ---------------------------------------------------------

    def _retry_or_fail(
        self,
        timer: store.DueTimer,
        attempts: int,
        token: int,
        exc: BaseException,
        now_ms: int,
        readd: list[Readd],
    ) -> None:
        error = sanitize_error(exc)
        if attempts < timer.max_attempts:
            backoff = Backoff(base_s=timer.backoff_base_s, max_s=timer.backoff_max_s)
            fire_at = now_ms + backoff.delay_ms(attempts)
            store.mark_retry(self.db, timer, attempts, fire_at, self.conf.BUCKET_SHIFT, error)
            readd.append((timer.shard, timer.id, fire_at))
            return
        store.mark_failed(self.db, timer, attempts, token, now_ms, error)
        if self.metrics is not None:
            self.metrics.on_dead_letter(timer.shard)
        event(
            log,
            logging.ERROR,
            "timer.dead_letter",
            timer=timer.id,
            target=timer.target,
            attempts=attempts,
            error=error,
        )
        if timer.on_complete:
            self._followup(timer, {"status": "failed", "error": error}, now_ms, readd)

    def _followup(
        self,
        timer: store.DueTimer,
        result: dict[str, Any],
        now_ms: int,
        out: BatchOutcome | list[Readd],
    ) -> None:
        from durable.storage.timers import create_followup

        follow = create_followup(timer, result, now_ms, using=self.db)
        if follow is None:
            return
        readd = out.readd if isinstance(out, BatchOutcome) else out
        readd.append((follow.shard, follow.pk, follow.fire_at_ms))

    def _resolve(self, timer: store.DueTimer) -> HandlerSpec:
        try:
            resolver = self.resolvers[timer.kind]
        except KeyError:
            raise LookupError(f"no dispatcher for timer kind {timer.kind!r}") from None
        return resolver(timer.target)

    # -- external handlers (executor threads) -------------------------------------------

    def _run_external(self, shard: int, token: int, timer: store.DueTimer) -> None:
        attempt = timer.attempts + 1
        readd: list[Readd] = []
        try:
            spec = self._resolve(timer)
            now_ms = self.clock.now_ms()
            ctx = _context(timer, attempt, now_ms, token, self.metrics)
            try:
                with firing(ctx):
                    value: Any = spec.fn(*timer.args, **timer.kwargs)
                error: BaseException | None = None
            except Exception as exc:
                value, error = None, exc
            if error is None and ctx.completed and not timer.on_complete:
                return  # the handler's last transaction marked the timer fired
            self._complete_external(shard, token, timer, attempt, value, error, readd)
        except LeaseLost as exc:
            event(
                log,
                logging.WARNING,
                "timer.complete_fenced",
                timer=timer.id,
                shard=shard,
                reason=str(exc),
            )
        except Exception:
            log.exception("external handler completion failed for timer %s", timer.id)
        finally:
            for item in readd:
                self.inbox.put(item)
            with self._lock:
                self._in_flight -= 1
            close_old_connections()

    def _ship(self, shard: int, token: int, timer: store.DueTimer) -> None:
        """Send a claimed timer to the executors; a failed publish is a failed attempt."""
        attempt = timer.attempts + 1
        readd: list[Readd] = []
        shipment = executors.Shipment(timer_id=timer.id, attempt=attempt, shard=shard, token=token)
        try:
            executors.ship(shipment, self.conf.BROKER_URL)
        except Exception as exc:  # broker down: retried with backoff, never lost
            try:
                self._complete_external(shard, token, timer, attempt, None, exc, readd)
            except Exception:
                log.exception("recording the failed shipment of timer %s failed", timer.id)
        finally:
            for item in readd:
                self.inbox.put(item)
            with self._lock:
                self._in_flight -= 1
            close_old_connections()

    def _complete_external(
        self,
        shard: int,
        token: int,
        timer: store.DueTimer,
        attempt: int,
        value: Any,
        error: BaseException | None,
        readd: list[Readd],
    ) -> None:
        now_ms = self.clock.now_ms()
        with transaction.atomic(using=self.db):
            fence(self.db, shard, token)
            if not store.still_claimed(self.db, timer.id, attempt):
                return  # cancelled, or reclaimed after our claim expired
            if error is not None:
                self._retry_or_fail(timer, attempt, token, error, now_ms, readd)
                return
            result = _json_value(value) if timer.on_complete else None
            store.mark_fired(
                self.db,
                [timer.id],
                {shard: token},
                now_ms,
                {timer.id: result} if result else None,
            )
            if timer.on_complete:
                self._followup(timer, {"status": "success", "value": result}, now_ms, readd)


def pack(work: Work, size: int) -> list[Work]:
    """Cut the due ids of many shards into batches of at most ``size`` ids in all.

    Shards keep their order and each shard's ids stay oldest first; a shard with more
    than ``size`` due ids is split across consecutive batches.
    """
    batches: list[Work] = []
    current: list[tuple[ShardRunner, Sequence[int]]] = []
    room = size
    for runner, ids in work:
        start = 0
        while start < len(ids):
            take = ids[start : start + room]
            current.append((runner, take))
            start += len(take)
            room -= len(take)
            if room == 0:
                batches.append(current)
                current, room = [], size
    if current:
        batches.append(current)
    return batches


def _context(
    timer: store.DueTimer, attempt: int, now_ms: int, token: int, metrics: Any = None
) -> FireContext:
    return FireContext(
        timer_id=timer.id,
        key=timer.key,
        attempt=attempt,
        scheduled_ms=timer.fire_at_ms,
        fired_ms=now_ms,
        shard=timer.shard,
        token=token,
        metrics=metrics,
    )


def _json_value(value: Any) -> Any:
    """The handler's return value if it is JSON, else None (results must stay storable)."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return value
