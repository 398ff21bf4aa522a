"""What a fired batch writes, and what follows its commit.

:class:`BatchRecorder` is the firer's bookkeeping (:mod:`durable.worker.firer`). Inside
the batch transaction it fails a timer found due with every attempt used, marks the
fired timers fired (with the results an ``on_complete`` reads), schedules follow-ups,
retries or dead-letters the failed ones, gives back the attempts of timers left for a
later batch and claims the external ones. Once the transaction committed it puts what
the batch scheduled into the wheels (or the engine's inbox), hands the external timers
to the :class:`ExternalRunner` (or parks them while no thread is free) and logs the
errors.
"""

from __future__ import annotations

import contextlib
import queue

from durable.conf import DurableSettings
from durable.core.clock import Clock
from durable.dispatch import kinds
from durable.exceptions import AttemptsExhausted
from durable.storage import claims, concurrency, statements
from durable.storage import firing as store
from durable.storage.notify import Announced
from durable.worker.admission import Admitted
from durable.worker.batches import BatchOutcome
from durable.worker.external import ExternalRunner
from durable.worker.outcomes import Outcomes, Readd, json_value
from durable.worker.runner import ShardRunner


class BatchRecorder:
    """Records a batch's outcomes and acts on them after commit (see the module docstring)."""

    def __init__(
        self,
        *,
        db: str,
        conf: DurableSettings,
        clock: Clock,
        outcomes: Outcomes,
        external: ExternalRunner,
        inbox: queue.SimpleQueue[Readd],
    ) -> None:
        self.db = db
        self.conf = conf
        self.clock = clock
        self.outcomes = outcomes
        self.external = external
        self.inbox = inbox

    def uncounted(self, timer: store.DueTimer, out: BatchOutcome) -> None:
        """A due timer whose attempt was not counted: all used up, or it came due since."""
        if timer.attempts >= timer.max_attempts:
            error = AttemptsExhausted(
                f"attempt {timer.attempts} of {timer.max_attempts} started and never finished "
                "(its worker died, hung past its timeout, or lost the shard)",
                timer=timer.id,
            )
            out.errors.append((timer, error))
        else:
            out.leftover.append(timer)

    def record(
        self,
        runners: dict[int, ShardRunner],
        outcomes: dict[int, BatchOutcome],
        batch: kinds.FiringBatch,
        counted: claims.Counted,
        admitted: Admitted,
    ) -> None:
        """In the batch transaction: mark the fired fired, schedule follow-ups, retry or
        dead-letter the failed, give back the attempts of the timers left for later
        (those a key admitted keep their place in its line), and claim the external ones."""
        now_ms = batch.now_ms
        left = {t.id for out in outcomes.values() for t in out.leftover + out.waiting}
        fired = [pair for out in outcomes.values() for pair in out.fired]
        results = {
            t.id: json_value(v, self.conf.MAX_RESULT_BYTES) for t, v in fired if t.on_complete
        }
        # fired_at is when the batch's handlers were done (and its publishes flushed),
        # not when it started: the row then says when the fire took effect.
        done_ms = self.clock.now_ms()
        # A keyed batch's settle writes (its keys' rate logs, its line) go in one round
        # trip with the UPDATE that marks the batch fired: none of them is read back.
        with statements.pipelined(self.db) if admitted.ids else contextlib.nullcontext():
            admitted.settle(self.db, left, now_ms)  # before any release below counts the line
            store.mark_fired(self.db, [t.id for t, _ in fired], batch.tokens, done_ms)
        store.store_results(self.db, results)
        external: list[int] = []
        leftover: list[int] = []
        for shard, out in outcomes.items():
            for timer, _ in out.fired:
                if timer.on_complete:
                    success = {"status": "success", "value": results[timer.id]}
                    self.outcomes.followup(timer, success, now_ms, out.readd)
            token = runners[shard].token
            for timer, exc in out.errors:
                self.outcomes.retry_or_fail(timer, timer.attempts, token, exc, now_ms, out.readd)
            external.extend(t.id for t, _ in out.external if t.id not in batch.claimed)
            leftover.extend(t.id for t in out.leftover + out.waiting if t.id in counted.ids)
        # A claimed timer that failed here (its claim expired with every attempt used,
        # say) frees a slot of its concurrency key: wake the next in line (announced).
        ended = [t.id for out in outcomes.values() for t, _ in out.errors]
        if ended:
            concurrency.release(self.db, ended, now_ms, self.conf.BUCKET_SHIFT)
        # Timers left for later were counted, not run: give their attempt back (an
        # older owner's expired claim included: it is still firing).
        claims.uncount(self.db, {i: counted.previous.get(i) for i in leftover})
        if external:
            durable = not batch.only_claims
            store.claim(self.db, external, batch.tokens, batch.claim_until_ms, durable=durable)

    def after_commit(
        self,
        by_shard: dict[int, ShardRunner],
        outcomes: dict[int, BatchOutcome],
        announced: Announced,
    ) -> None:
        """After the batch committed: wheel what it scheduled, submit or park its external
        timers, log its errors."""
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
            for timer in out.waiting:
                self.external.park(shard, timer.id, timer.fire_at_ms)
            for timer, spec in out.external:
                self.external.submit(shard, runner.token, timer, spec)
            for timer, exc in out.errors:
                self.outcomes.log_error(timer, timer.attempts, exc, count=False)
