"""The firer's side of concurrency keys: which of a batch's timers a key's limits hold back.

The decision itself is :func:`durable.storage.concurrency.admit`'s, in the batch's
fenced transaction. ``max_concurrency`` binds external handlers (``atomic=False``) only:
an atomic handler starts and finishes inside its batch transaction, on the one thread
that fires its shard, so no two of a key's atomic handlers ever run at once anyway.
``rate_limit`` binds both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from durable.dispatch.registry import HandlerSpec
from durable.storage import claims, concurrency
from durable.storage.firing import DueTimer


def admit(
    db: str,
    due: list[DueTimer],
    counted: claims.Counted,
    lookup: Callable[[str], HandlerSpec | None],
    now_ms: int,
    bucket_shift: int,
) -> list[DueTimer]:
    """``due`` without the timers parked for their key's limit (no query when none is limited).

    Only timers whose attempt was counted for this batch are decided on; a held suspect
    or an uncounted timer is left as it is (the firer deals with them).
    """
    limits: dict[int, concurrency.Limits] = {}
    for timer in due:
        if timer.kind != "handler" or timer.id not in counted.ids or timer.id in counted.held:
            continue
        spec = lookup(timer.target)
        policy = None if spec is None else spec.concurrency
        # An atomic handler's attempts never overlap (see the module docstring): only its
        # rate needs deciding.
        if policy is not None and (policy.rate is not None or not spec.atomic):
            limits[timer.id] = (policy.max_concurrency, policy.rate)
    if not limits:
        return due
    parked = concurrency.admit(db, limits, now_ms, bucket_shift)
    return [timer for timer in due if timer.id not in parked] if parked else due


def release(
    db: str, specs: Sequence[tuple[int, HandlerSpec]], now_ms: int, bucket_shift: int
) -> list[concurrency.Woken]:
    """After ``(timer id, spec)`` attempts ended: wake the next of their keys' lines."""
    ids = [timer_id for timer_id, spec in specs if spec.concurrency is not None]
    return concurrency.release(db, ids, now_ms, bucket_shift) if ids else []
