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

Every attempt is counted before its handler runs, in a short transaction of its own
(:func:`durable.storage.claims.count_attempts`; the next batch's while this one records
and commits, :mod:`durable.worker.ahead`), so a handler that takes the process down has
used its attempt all the same; a timer due again with every attempt used is dead-lettered
(:class:`~durable.exceptions.AttemptsExhausted`), and a *suspect* (an attempt of it
started and never recorded an outcome) runs alone in a batch of its own, counted only
then, so it costs no neighbour an attempt again, nor a neighbour it. A handler that raises
anything, a ``BaseException`` included, fails only its own attempt; an atomic one that
runs past its timeout is interrupted (:mod:`durable.worker.deadline`).

External handlers (``atomic=False``) are claimed in the batch transaction, under the
shard's lease token, and run on :class:`~durable.worker.external.ExternalRunner`'s threads
after commit; the firer claims no more of them than it has free threads. A crash in
between leaves the claim to the shard's next owner, which re-runs it at once
(:func:`durable.storage.claims.release_stale_claims`).

On PostgreSQL a due timer whose row another session holds locked (a transaction that
cancelled or rescheduled it and is still open) does not hold the batch: the count skips
it (:attr:`durable.storage.claims.Counted.locked`), the batch runs without it, and its
runner tries it again :data:`LOCKED_RETRY_MS` later (:mod:`durable.worker.counting`),
until the row is free. What a batch writes about its outcomes, and what follows its
commit, is :class:`~durable.worker.recording.BatchRecorder`'s.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable

from django.db import InterfaceError, OperationalError, transaction

from durable.conf import DurableSettings
from durable.core.clock import Clock
from durable.dispatch import kinds
from durable.dispatch.broker import DeferredPublishError, publishers
from durable.dispatch.registry import HandlerRegistry, HandlerSpec
from durable.metrics import WorkerMetrics
from durable.storage import claims
from durable.storage import firing as store
from durable.storage.notify import Announced, collecting
from durable.worker import admission, counting
from durable.worker.ahead import CountAhead
from durable.worker.attempts import AttemptTracker
from durable.worker.batches import BatchOutcome, Work, merge
from durable.worker.calls import BatchCalls
from durable.worker.counting import LOCKED_RETRY_MS
from durable.worker.external import ExternalRunner
from durable.worker.logs import event
from durable.worker.outcomes import Outcomes, Readd
from durable.worker.pool import HandlerPool
from durable.worker.recording import BatchRecorder
from durable.worker.runner import ShardRunner

log = logging.getLogger("durable.worker")

__all__ = ["LOCKED_RETRY_MS", "Firer"]  # LOCKED_RETRY_MS: durable.worker.counting's


class _Rollback(Exception):
    """A handler raised on the fast path: roll the batch back and redo it carefully."""

    def __init__(self, timer_id: int, error: BaseException) -> None:
        super().__init__(timer_id, error)
        self.timer_id = timer_id
        self.error = error


class _Fenced(Exception):
    """Some shards of the batch are no longer ours: roll back, redo without them."""

    def __init__(self, stale: dict[int, int | None]) -> None:
        super().__init__(stale)
        self.stale = stale


class Firer:
    """Runs batches of due timers for the engine's shard runners."""

    def __init__(
        self,
        *,
        db: str,
        conf: DurableSettings,
        clock: Clock,
        registry: HandlerRegistry,
        pool: HandlerPool,
        inbox: queue.SimpleQueue[Readd],
        resolvers: dict[str, Callable[[str], HandlerSpec]] | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.db = db
        self.conf = conf
        self.clock = clock
        self.inbox = inbox
        self.resolvers = {"handler": registry.resolve, **(resolvers or {})}
        self.lookup = registry.get
        self.metrics = metrics
        self.outcomes = Outcomes(db=db, conf=conf, metrics=metrics)
        self.external = ExternalRunner(
            db=db,
            conf=conf,
            clock=clock,
            pool=pool,
            inbox=inbox,
            outcomes=self.outcomes,
            metrics=metrics,
        )
        self.recorder = BatchRecorder(
            db=db,
            conf=conf,
            clock=clock,
            outcomes=self.outcomes,
            external=self.external,
            inbox=inbox,
        )
        self.calls = BatchCalls(conf=conf, resolvers=self.resolvers, metrics=metrics)
        self.quarantined: set[int] = set()
        """Timers whose bookkeeping failed even alone: not fired again by this process."""
        self.attempts = AttemptTracker(db, claims.Counted(), {})
        """The current :meth:`fire` call's attempts (given back if its batch fails)."""
        self.ahead = CountAhead(db, clock)
        """The next batch's count, made while the current one records and commits."""
        self._ahead: Work | None = None

    @property
    def in_flight(self) -> int:
        """External handlers submitted and not yet completed."""
        return self.external.in_flight

    # -- batches -------------------------------------------------------------------------

    def fire(self, work: Work, ahead: Work = ()) -> dict[int, BatchOutcome]:
        """Fire one batch: due ids of one or more shards; return an outcome per shard.

        Firing the due timers of many shards together is what keeps lateness low at a
        steady rate: with 64 shards, a turn finds a timer or two in most of them, and a
        transaction per shard would pay a commit (a WAL flush) for each. Keep a batch to
        ``BATCH_SIZE`` ids in all (see :func:`pack`). A shard whose lease was lost gets an
        outcome with ``lost`` set (nothing of it fired), and the other shards still fire.
        Suspects held by the count (see :mod:`durable.storage.claims`) fire after the
        rest, one per batch, each counted just before: a neighbour that takes the process
        down must not cost them an attempt they never started, nor they their neighbours.
        ``ahead``, the batch the caller fires next, is counted once this one's handlers
        ran, while it records and commits (:mod:`durable.worker.ahead`).
        """
        work = self._unquarantined(work)
        outcomes: dict[int, BatchOutcome] = {}
        lost: dict[int, str] = {}
        found = self.ahead.take(work)  # counted while the batch before ran
        counted = counting.count(self.db, self.clock, work, lost) if found is None else found[0]
        lost.update(found[1] if found is not None else {})
        self._ahead = self._unquarantined(ahead) if self.ahead.enabled() else None
        work = [(runner, ids) for runner, ids in work if runner.shard not in lost]
        work = counting.skip_locked(self.clock, work, counted.locked, self.metrics)
        runners = {runner.shard: runner for runner, _ in work}
        tokens = {i: runner.token for runner, ids in work for i in ids if i in counted.ids}
        self.attempts = attempts = AttemptTracker(self.db, counted, tokens)
        parts: list[tuple[Work, bool]] = [(work, False)]
        try:
            while parts:
                part, alone_part = parts.pop(0)
                part = [(r, ids) for r, ids in part if ids and r.shard not in lost]
                if alone_part:  # a held suspect: counted now, alone
                    found = counting.recount(self.db, self.clock, part, counted, lost, attempts)
                    part = counting.skip_locked(self.clock, part, found, self.metrics)
                done = self._fire_contained(part, counted, lost)
                alone = {timer.id for outcome in done.values() for timer in outcome.alone}
                attempts.settle(i for r, ids in part if r.shard in done for i in ids)
                attempts.settled -= alone
                for shard, outcome in done.items():
                    merge(outcomes.setdefault(shard, BatchOutcome()), outcome)
                    parts += [([(runners[shard], [timer.id])], True) for timer in outcome.alone]
                    outcome.alone.clear()
        except (OperationalError, InterfaceError):  # this worker lives: durable.worker.attempts
            attempts.give_back(self.clock.now_ms(), reconnect=True)
            self._ahead = None
            self.ahead.drop()
            raise
        attempts.give_back(self.clock.now_ms(), reconnect=False)  # shards lost meanwhile
        self._start_ahead()  # if not started yet (suspects ran alone, say)
        return outcomes | {shard: BatchOutcome(lost=why) for shard, why in lost.items()}

    def _start_ahead(self) -> None:
        work, self._ahead = self._ahead, None
        if work is not None:
            self.ahead.start(work)

    def _unquarantined(self, work: Work) -> Work:
        work = [(r, [i for i in ids if i not in self.quarantined]) for r, ids in work]
        return [(runner, ids) for runner, ids in work if ids]

    def _fire_contained(
        self, work: Work, counted: claims.Counted, lost: dict[int, str]
    ) -> dict[int, BatchOutcome]:
        """:meth:`_fire_batch`; an error of the batch's own (not a handler's: a database
        error in durable's bookkeeping, say) splits the batch, and a timer whose firing
        fails even alone is dead-lettered (or, failing that, set aside)."""
        if not work:
            return {}
        try:
            return self._fire_batch(work, counted, lost)
        except (OperationalError, InterfaceError):
            raise  # the database is unreachable: the engine reconnects
        except Exception as exc:  # a value the bookkeeping cannot store, say
            ids = [(runner, timer_id) for runner, chunk in work for timer_id in chunk]
            if len(ids) > 1:
                outcomes: dict[int, BatchOutcome] = {}
                for runner, timer_id in ids:
                    for shard, out in self._fire_contained(
                        [(runner, [timer_id])], counted, lost
                    ).items():
                        merge(outcomes.setdefault(shard, BatchOutcome()), out)
                return outcomes
            runner, timer_id = ids[0]
            self._give_up(runner, timer_id, exc)
            return {runner.shard: BatchOutcome()}

    def _fire_batch(
        self, work: Work, counted: claims.Counted, lost: dict[int, str]
    ) -> dict[int, BatchOutcome]:
        """One fenced transaction (redone carefully, or without lost shards, as needed).

        Its redos share the first try's time budget: a handler that hung to its timeout
        spent it, and a redo with a budget of its own could run the next one that hangs
        before the loop renews its leases again (found by the chaos run: two hanging
        atomic handlers in one batch held a worker's loop past ``LEASE_TTL_S``)."""
        deadline = time.monotonic() + self.conf.BATCH_TIME_BUDGET_S
        while work:
            try:
                try:
                    outcomes, announced = self._batch(work, counted, deadline)
                except _Rollback as failed:
                    # The careful redo records the known failure without calling that
                    # handler again; those before it run again (first effects rolled back).
                    failure = {failed.timer_id: failed.error}
                    outcomes, announced = self._batch(work, counted, deadline, failed=failure)
                except DeferredPublishError as exc:
                    # Some messages may have gone out: the careful redo sends them again
                    # (at least once; the task ids are the same).
                    event(log, logging.WARNING, "batch.publish_failed", error=str(exc))
                    outcomes, announced = self._batch(work, counted, deadline, failed={})
                except kinds.RedoCarefully:
                    outcomes, announced = self._batch(work, counted, deadline, failed={})
            except _Fenced as fenced:
                for shard, current in fenced.stale.items():
                    lost[shard] = f"lease of shard {shard} lost: token is stale (now {current})"
                work = [(runner, ids) for runner, ids in work if runner.shard not in lost]
                continue
            self.recorder.after_commit(
                {runner.shard: runner for runner, _ in work}, outcomes, announced
            )
            return outcomes
        return {}

    def _batch(
        self,
        work: Work,
        counted: claims.Counted,
        deadline: float,
        *,
        failed: dict[int, BaseException] | None = None,
    ) -> tuple[dict[int, BatchOutcome], Announced]:
        """One fenced transaction. ``failed`` set means careful mode: a savepoint per handler."""
        runners = {runner.shard: runner for runner, _ in work}
        outcomes = {shard: BatchOutcome() for shard in runners}
        ids = [timer_id for _, chunk in work for timer_id in chunk]
        now_ms = self.clock.now_ms()
        free = self.external.free
        with transaction.atomic(using=self.db), collecting() as announced:
            tokens = {shard: runner.token for shard, runner in runners.items()}
            # This lock waits (no SKIP LOCKED): the count just before skipped the rows
            # locked then, so only a lock taken in the few milliseconds between the two
            # statements holds it. Skipping here would leave such a row counted and not
            # run, and giving its attempt back would wait on the same lock (or leave it a
            # suspect): a rare wait is the smaller harm.
            stale, due = store.fence_and_lock_due(self.db, tokens, ids, now_ms)
            if stale:
                raise _Fenced(stale)
            shift = self.conf.BUCKET_SHIFT  # over their key's limit: parked (not in due)
            admitted = admission.Admitted()
            due = admission.admit(self.db, due, counted, self.lookup, now_ms, shift, admitted)
            # Fast path: broker publishes (Celery timers) are held and sent in one flush
            # before the commit, and kinds do their batch-wide work once (cron locks all
            # its schedule rows in one read); the careful redo goes one timer at a time,
            # so that a failure is pinned on its own timer.
            fast = failed is None
            batch = kinds.FiringBatch(
                now_ms=now_ms,
                claim_until_ms=now_ms + int(self.conf.CLAIM_TIMEOUT_S * 1000),
                tokens=tokens,
            )
            with (
                publishers.deferred() if fast else contextlib.nullcontext(),
                kinds.batch_scopes(self.db, due, batch) if fast else contextlib.nullcontext(),
                self.calls.batch(),
            ):
                for timer in due:
                    out = outcomes[timer.shard]
                    if timer.id in counted.held:
                        out.alone.append(timer)  # fires after the batch, in one of its own
                    elif timer.id not in counted.ids:
                        if self.attempts.refund_exhausted(timer, lambda t=timer: self._external(t)):
                            out.leftover.append(timer)  # the next batch counts and runs it
                        else:
                            self.recorder.uncounted(timer, out)
                    elif time.monotonic() > deadline and timer.id not in (failed or ()):
                        out.leftover.append(timer)  # budget spent: next batch takes it
                    else:
                        out.lateness_ms.append(now_ms - timer.fire_at_ms)
                        if self._run_one(timer, now_ms, tokens[timer.shard], failed, out, free):
                            batch.sent.add(timer.id)
                            free -= 1
                # With ASYNC_COMMIT, a batch that only claimed commits asynchronously
                # (see store.claim); by default every batch commits synchronously.
                batch.only_claims = self.conf.ASYNC_COMMIT and not any(
                    o.fired or o.errors for o in outcomes.values()
                )
            if not counted.held:  # every handler ran (suspects alone after it included)
                self._start_ahead()
            self.recorder.record(runners, outcomes, batch, counted, admitted)
        return outcomes, announced

    def _run_one(
        self,
        timer: store.DueTimer,
        now_ms: int,
        token: int,
        failed: dict[int, BaseException] | None,
        out: BatchOutcome,
        free: int,
    ) -> bool:
        """Run one counted timer, or take it for the executor (then return True)."""
        try:
            call = self.calls.lookup(timer)
        except Exception as exc:  # unknown handler, unknown kind: retried, then dead letter
            out.errors.append((timer, exc))
            return False
        spec = call[0]
        if not spec.atomic or timer.kind in self.external.shipped:
            timer = self.attempts.refund_unstarted(timer)
            if free <= 0:
                out.waiting.append(timer)  # no free thread: parked until one is
                return False
            out.external.append((timer, spec))
            return True
        if failed is None:
            self.attempts.started.add(timer.id)
            try:
                out.fired.append((timer, self.calls.call(timer, call, now_ms, token)))
            except kinds.RedoCarefully:
                raise
            except BaseException as exc:  # any failure is this timer's: redo carefully
                self.attempts.blame(timer.id, exc)
                raise _Rollback(timer.id, spec.failure(exc)) from exc
            return False
        if timer.id in failed:
            out.errors.append((timer, failed[timer.id]))
            return False
        self.attempts.started.add(timer.id)
        try:
            with transaction.atomic(using=self.db):
                out.fired.append((timer, self.calls.call(timer, call, now_ms, token)))
        except BaseException as exc:  # its savepoint rolled its own effects back
            self.attempts.blame(timer.id, exc)
            out.errors.append((timer, spec.failure(exc)))
        return False

    def _external(self, timer: store.DueTimer) -> bool:
        """Whether ``timer``'s handler runs after its batch commits (False if unknown)."""
        try:
            spec = self.calls.lookup(timer)[0]
        except Exception:
            return False  # the dead letter's error says why
        return not spec.atomic or timer.kind in self.external.shipped

    def _give_up(self, runner: ShardRunner, timer_id: int, exc: Exception) -> None:
        """Dead-letter a timer whose firing failed alone on an error of its own; if even
        that fails, set it aside for this process's life."""
        now_ms = self.clock.now_ms()
        if not self.outcomes.give_up(runner.shard, runner.token, timer_id, exc, now_ms):
            self.quarantined.add(timer_id)
