"""What an attempt came to, recorded: success follow-ups, retries, dead letters, error logs.

Shared by the batch firer (:mod:`durable.worker.firer`), whose atomic handlers' outcomes
are written in the batch transaction, and by the external runner
(:mod:`durable.worker.external`), whose handlers' outcomes are written in a fenced
transaction of their own. Both log and count every failed attempt the same way.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from django.db import DatabaseError, transaction

from durable.conf import DurableSettings
from durable.core.backoff import Backoff
from durable.core.errors import sanitize_error
from durable.dispatch import giveup, kinds
from durable.exceptions import LeaseLost
from durable.metrics import WorkerMetrics
from durable.storage import claims
from durable.storage import firing as store
from durable.storage.leases import fence
from durable.worker.logs import event

log = logging.getLogger("durable.worker")

#: (shard, timer id, fire_at_ms) to put back in a wheel, from any thread.
Readd = tuple[int, int, int]


class Outcomes:
    """Records the end of one attempt; call inside the transaction that completes it."""

    def __init__(self, *, db: str, conf: DurableSettings, metrics: WorkerMetrics | None) -> None:
        self.db = db
        self.conf = conf
        self.metrics = metrics

    def retry_or_fail(
        self,
        timer: store.DueTimer,
        attempt: int,
        token: int,
        exc: BaseException,
        now_ms: int,
        readd: list[Readd],
    ) -> None:
        """Attempt ``attempt`` failed: put the timer back at now + backoff, or dead-letter it
        (at once, attempts left or not, if the failure is final: ``GiveUp``)."""
        error = giveup.error_text(exc)
        gave_up = giveup.is_final(exc)
        if attempt < timer.max_attempts and not gave_up:
            backoff = Backoff(base_s=timer.backoff_base_s, max_s=timer.backoff_max_s)
            fire_at = now_ms + backoff.delay_ms(attempt)
            store.mark_retry(self.db, timer, attempt, fire_at, self.conf.BUCKET_SHIFT, error)
            readd.append((timer.shard, timer.id, fire_at))
            return
        store.mark_failed(self.db, timer, attempt, token, now_ms, error)
        kinds.dead_lettered(self.db, timer, error, now_ms)
        if self.metrics is not None:
            self.metrics.on_dead_letter(timer.shard)
        event(
            log,
            logging.ERROR,
            "timer.dead_letter",
            timer=timer.id,
            target=timer.target,
            attempts=attempt,
            error=error,
            gave_up=gave_up,
        )
        if timer.on_complete:
            self.followup(timer, {"status": "failed", "error": error}, now_ms, readd)

    def followup(
        self, timer: store.DueTimer, result: dict[str, Any], now_ms: int, readd: list[Readd]
    ) -> None:
        """Schedule the timer's ``on_complete`` handler now with ``result``."""
        from durable.storage.timers import create_followup

        follow = create_followup(timer, result, now_ms, using=self.db)
        if follow is not None:
            readd.append((follow.shard, follow.pk, follow.fire_at_ms))

    def give_up(self, shard: int, token: int, timer_id: int, exc: Exception, now_ms: int) -> bool:
        """Dead-letter a timer whose firing failed alone on an error of durable's own (a
        value its bookkeeping cannot store, say), in a fenced transaction of its own.

        False when even that failed (the caller then sets the timer aside); True when it
        is dead-lettered, finished already, or no longer this worker's.
        """
        error = f"firing it failed outside its handler: {sanitize_error(exc)}"
        try:
            with transaction.atomic(using=self.db):
                fence(self.db, shard, token)
                done = claims.dead_letter(self.db, timer_id, token, now_ms, error)
        except LeaseLost:
            return True
        except DatabaseError as again:
            error = f"{error}; dead-lettering it failed too: {sanitize_error(again)}"
            event(log, logging.ERROR, "timer.quarantined", timer=timer_id, shard=shard, error=error)
            return False
        if done:
            if self.metrics is not None:
                self.metrics.on_dead_letter(shard)
            event(log, logging.ERROR, "timer.dead_letter", timer=timer_id, shard=shard, error=error)
        return True

    def log_error(
        self, timer: store.DueTimer, attempt: int, exc: BaseException, *, count: bool = True
    ) -> None:
        """Log one failed attempt (after its outcome committed), and count it unless told
        not to (a batch's errors are counted with the batch)."""
        if count and self.metrics is not None:
            self.metrics.on_handler_error(timer.shard)
        event(
            log,
            logging.WARNING,
            "timer.error",
            timer=timer.id,
            target=timer.target,
            attempt=attempt,
            error=giveup.error_text(exc),
        )


def json_value(value: Any, max_bytes: int) -> Any:
    """The handler's return value if it is JSON of at most ``max_bytes``
    (``DURABLE["MAX_RESULT_BYTES"]``), else None: results must stay storable."""
    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return value if len(text.encode(errors="replace")) <= max_bytes else None
