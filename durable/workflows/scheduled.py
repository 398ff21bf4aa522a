"""Scheduled signals: ``send_signal(run, name, payload, at=... | delay=...)``.

A scheduled signal is a durable timer of kind ``signal`` (target the run id, ``args``
``[name, payload]``), written in the caller's transaction: a rollback leaves nothing,
and ``durable.cancel(timer)`` before it fires means it is never delivered. When it
fires, its handler delivers the signal exactly as an immediate ``send_signal`` does,
atomically, inside the firing batch's transaction: the signal row and the run's wake-up
commit with the timer marked fired, or not at all.

A run that finished (or vanished) by then takes no more signals, as for
``send_signal``; the fire raises :class:`~durable.exceptions.GiveUp`, so the timer is
dead-lettered at once with that error (retrying could not help). ``cancel_workflow``
cancels a run's pending scheduled signals with its wake-ups.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from django.db import transaction

from durable.conf import get_settings
from durable.core.sharding import bucket_of
from durable.dispatch.kinds import register_kind
from durable.dispatch.registry import HandlerSpec
from durable.exceptions import GiveUp, UnknownWorkflow, WorkflowError
from durable.models import Timer, TimerKind, TimerState
from durable.scheduling.validation import check_stored
from durable.storage import workflows as store
from durable.storage.timers import announce, insert_timer, new_timer

__all__ = ["deliver", "resolve", "schedule_signal"]


def schedule_signal(run_id: str, name: str, payload: Any, fire_at_ms: int, now_ms: int) -> Timer:
    """Write the ``signal`` timer that sends ``name`` to run ``run_id`` at ``fire_at_ms``.

    ``name`` is checked by the caller. Raises :class:`~durable.exceptions.PayloadError`
    for a payload that is not JSON or exceeds ``DURABLE["MAX_PAYLOAD_BYTES"]``,
    :class:`~durable.exceptions.UnknownWorkflow` for an unknown run and
    :class:`~durable.exceptions.WorkflowError` for a finished one, before any write.
    """
    conf = get_settings()
    check_stored(payload, "payload", conf.MAX_PAYLOAD_BYTES, "MAX_PAYLOAD_BYTES")
    db = conf.DATABASE
    run = store.runs_by_ids(db, [run_id]).get(run_id)
    if run is None:
        raise UnknownWorkflow(f"no workflow run with id {run_id!r}", run_id=run_id)
    if run.finished:
        raise WorkflowError(f"run {run_id} is {run.state}; it takes no more signals", run_id=run_id)
    timer = new_timer(
        shard=run.shard,  # the run's: its wake-ups and its signals go to one owner
        bucket=bucket_of(fire_at_ms, conf.BUCKET_SHIFT),
        fire_at_ms=fire_at_ms,
        state=TimerState.PENDING,
        kind=TimerKind.SIGNAL,
        target=run_id,
        args=[name, payload],
        max_attempts=conf.MAX_ATTEMPTS,
        backoff_base_s=conf.BACKOFF_BASE_S,
        backoff_max_s=conf.BACKOFF_MAX_S,
    )
    with transaction.atomic(using=db, savepoint=False):
        insert_timer(db, timer)
        announce(db, [timer], now_ms)
    return timer


def deliver(run_id: str, name: str, payload: Any) -> None:
    """The handler of a ``signal`` timer: send the signal now, in the firing transaction.

    A run that finished or no longer exists raises :class:`GiveUp` (dead letter at once).
    """
    from durable.workflows.operations import send_signal

    try:
        send_signal(run_id, name, payload)
    except WorkflowError as exc:  # UnknownWorkflow too
        raise GiveUp(cause=exc) from exc


def resolve(run_id: str) -> HandlerSpec:
    """The ``signal`` kind's resolver: an atomic handler delivering to run ``run_id``."""
    return HandlerSpec(name=f"signal:{run_id}", fn=partial(deliver, run_id), atomic=True)


register_kind("signal", resolve)
