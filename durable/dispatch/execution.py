"""Executing one shipment: run the claimed timer's handler and commit its fenced completion.

The executor side of ``DISPATCH = "kombu"`` (see :mod:`durable.dispatch.executors`, which
consumes the queue and re-exports these names). :func:`execute` checks the claim, marks it
taken, runs the handler (atomic ones inside the completion's transaction, others outside
any) and settles the attempt: fired, retried with backoff, or dead-lettered. Every
completion re-reads the row under a lock and commits only if the shipped attempt's claim
still stands; otherwise the outcome is ``STALE`` and nothing is written.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from django.db import transaction

from durable.core.backoff import Backoff
from durable.core.clock import Clock
from durable.dispatch import giveup
from durable.dispatch.context import FireContext, firing
from durable.dispatch.registry import HandlerSpec, check_stored_call
from durable.exceptions import AttemptsExhausted
from durable.models import Timer
from durable.storage import concurrency
from durable.storage import firing as store
from durable.storage import timers as timer_store
from durable.storage.notify import notify_timers
from durable.storage.timers import create_followup

log = logging.getLogger("durable.executor")

#: Outcomes of :func:`execute`.
DONE, RETRY, FAILED, STALE = "done", "retry", "failed", "stale"

Resolvers = dict[str, Callable[[str], HandlerSpec]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Shipment:
    """What travels on the queue: which claimed timer, which attempt, fenced by whom."""

    timer_id: int
    attempt: int
    """The attempt number the claim counted; the completion requires it to still match."""
    shard: int
    token: int
    """The worker's lease token when it claimed (recorded as ``fired_token``)."""

    def to_json(self) -> dict[str, int]:
        """The message body."""
        return asdict(self)

    @classmethod
    def from_json(cls, body: Any) -> Shipment:
        """Parse a message body; ``ValueError`` if it is not a shipment."""
        if isinstance(body, str | bytes):
            body = json.loads(body)
        fields = ("timer_id", "attempt", "shard", "token")
        if not isinstance(body, dict) or set(body) != set(fields):
            raise ValueError(f"not a durable shipment: {body!r:.200}")
        values = {name: body[name] for name in fields}
        if not all(type(value) is int for value in values.values()):
            raise ValueError(f"not a durable shipment: {body!r:.200}")
        return cls(**values)


def execute(shipment: Shipment, *, db: str, clock: Clock, resolvers: Resolvers) -> str:
    """Run the shipped timer's handler and commit its completion; return the outcome.

    ``STALE`` when the claim no longer stands (cancelled, completed, or re-fired under
    another attempt): nothing runs, nothing is written.
    """
    timer = _claimed(db, shipment, lock=False)
    if timer is None:
        return STALE
    taken = timer_store.start_execution(db, shipment.timer_id, shipment.attempt, shipment.token)
    if taken == "died":
        # A redelivery: the executor that took this attempt died before completing it,
        # perhaps killed by the handler itself. The attempt failed; running it again here
        # would let one poison timer take down executors for ever.
        error = AttemptsExhausted(
            f"attempt {shipment.attempt} was taken by an executor that died before finishing",
            timer=shipment.timer_id,
        )
        return record_failure(db, clock, shipment, error)
    try:
        spec = resolvers[timer.kind](timer.target)
        check_stored_call(timer.args, timer.kwargs)  # a bad row fails for good
    except Exception as exc:  # unknown handler or kind: retried, then dead letter
        with transaction.atomic(using=db):
            locked = _claimed(db, shipment, lock=True)
            return STALE if locked is None else _settle(db, clock, shipment, locked, None, exc)
    if spec.atomic:
        return _execute_atomic(db, clock, shipment, spec)
    return _execute_external(db, clock, shipment, timer, spec)


def _execute_atomic(db: str, clock: Clock, shipment: Shipment, spec: HandlerSpec) -> str:
    with transaction.atomic(using=db):
        timer = _claimed(db, shipment, lock=True)
        if timer is None:
            return STALE
        error: BaseException | None = None
        value: Any = None
        try:
            with transaction.atomic(using=db), firing(_context(timer, shipment, clock)):
                value = spec.fn(*timer.args, **timer.kwargs)
        except BaseException as exc:  # its savepoint rolled its own effects back
            error = spec.failure(exc)  # contained; final if GiveUp or give_up_on/retry_on
        return _settle(db, clock, shipment, timer, value, error)


def _execute_external(
    db: str, clock: Clock, shipment: Shipment, timer: Timer, spec: HandlerSpec
) -> str:
    error: BaseException | None = None
    value: Any = None
    try:
        with firing(_context(timer, shipment, clock)):
            value = spec.fn(*timer.args, **timer.kwargs)
    except BaseException as exc:  # SystemExit and the like fail the attempt, not the process
        error = spec.failure(exc)
    with transaction.atomic(using=db):
        locked = _claimed(db, shipment, lock=True)
        if locked is None:
            return STALE
        return _settle(db, clock, shipment, locked, value, error)


def _claimed(db: str, shipment: Shipment, *, lock: bool) -> Timer | None:
    """The timer if our claim (state firing, that attempt) stands; locked when asked."""
    return timer_store.claimed_timer(db, shipment.timer_id, shipment.attempt, lock=lock)


def _settle(
    db: str,
    clock: Clock,
    shipment: Shipment,
    timer: Timer,
    value: Any,
    error: BaseException | None,
) -> str:
    """Record the outcome of one attempt, inside the caller's fenced transaction; its end
    frees a slot of the timer's concurrency key, if it has one (the next is made due)."""
    outcome = _record(db, clock, shipment, timer, value, error)
    if timer.concurrency_key is not None:
        concurrency.release(db, [timer.pk], clock.now_ms(), _bucket_shift())
    return outcome


def _record(
    db: str,
    clock: Clock,
    shipment: Shipment,
    timer: Timer,
    value: Any,
    error: BaseException | None,
) -> str:
    now_ms = clock.now_ms()
    if error is None:
        result = _json_value(value) if timer.on_complete else None
        # Only results an on_complete reads are stored (as the worker does), so a
        # result the handler wrote itself (Django tasks) is not overwritten.
        results = {timer.pk: result} if result is not None else None
        store.mark_fired(db, [timer.pk], {timer.shard: shipment.token}, now_ms, results)
        create_followup(timer, {"status": "success", "value": result}, now_ms, using=db)
        return DONE
    text = giveup.error_text(error)
    _log(logging.WARNING, "timer.error", timer=timer.pk, target=timer.target, error=text)
    if shipment.attempt < timer.max_attempts and not giveup.is_final(error):
        backoff = Backoff(base_s=timer.backoff_base_s, max_s=timer.backoff_max_s)
        fire_at = now_ms + backoff.delay_ms(shipment.attempt)
        # mark_retry/mark_failed read only the id of the DueTimer they are typed for.
        due: Any = timer
        store.mark_retry(db, due, shipment.attempt, fire_at, _bucket_shift(), text)
        notify_timers(db, [(timer.shard, timer.pk, fire_at)])
        return RETRY
    due = timer
    store.mark_failed(db, due, shipment.attempt, shipment.token, now_ms, text)
    _log(logging.ERROR, "timer.dead_letter", timer=timer.pk, target=timer.target, error=text)
    create_followup(timer, {"status": "failed", "error": text}, now_ms, using=db)
    return FAILED


def record_failure(db: str, clock: Clock, shipment: Shipment, error: BaseException) -> str:
    """Record ``error`` as the failed attempt of ``shipment`` (retry or dead letter), in a
    transaction of its own; ``STALE`` if the claim no longer stands."""
    with transaction.atomic(using=db):
        locked = _claimed(db, shipment, lock=True)
        return STALE if locked is None else _settle(db, clock, shipment, locked, None, error)


def _bucket_shift() -> int:
    from durable.conf import get_settings

    return get_settings().BUCKET_SHIFT


def _context(timer: Timer, shipment: Shipment, clock: Clock) -> FireContext:
    return FireContext(
        timer_id=timer.pk,
        key=timer.key,
        attempt=shipment.attempt,
        scheduled_ms=timer.fire_at_ms,
        fired_ms=clock.now_ms(),
        shard=timer.shard,
        token=shipment.token,
    )


def _json_value(value: Any) -> Any:
    # As the worker does: a result that is not JSON, or is larger than
    # DURABLE["MAX_RESULT_BYTES"], is stored as None.
    from durable.conf import get_settings

    try:
        text = json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    fits = len(text.encode(errors="replace")) <= get_settings().MAX_RESULT_BYTES
    return value if fits else None


def _log(level: int, name: str, **fields: Any) -> None:
    if log.isEnabledFor(level):
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        log.log(level, "%s %s", name, text, extra={"durable": {"event": name, **fields}})
