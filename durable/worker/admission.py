"""The firer's side of concurrency keys: which of a batch's timers a key's limits hold back.

The decision itself is :func:`durable.storage.concurrency.admit`'s, in the batch's
fenced transaction. ``max_concurrency`` binds external handlers (``atomic=False``) only:
an atomic handler starts and finishes inside its batch transaction, on the one thread
that fires its shard, so no two of a key's atomic handlers ever run at once anyway.
``rate_limit`` binds both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from durable.dispatch.registry import HandlerSpec
from durable.storage import claims, concurrency
from durable.storage.firing import DueTimer


@dataclass(slots=True)
class Admitted:
    """A batch's timers admitted by their key's limits (empty when none is limited)."""

    ids: set[int] = field(default_factory=set)
    """Every admitted timer of a limited handler."""
    from_line: dict[int, int] = field(default_factory=dict)
    """Those of them that waited in their key's line, with their place (``queued_ms``)."""

    def settle(self, db: str, left: set[int], now_ms: int) -> None:
        """The batch ran all but ``left``: see :func:`durable.storage.concurrency.settle`.

        No query when no timer of the batch was admitted by a key.
        """
        if self.ids:
            started = sorted(set(self.from_line) - left)
            concurrency.settle(db, started, sorted(self.ids & left), now_ms)


def admit(
    db: str,
    due: list[DueTimer],
    counted: claims.Counted,
    lookup: Callable[[str], HandlerSpec | None],
    now_ms: int,
    bucket_shift: int,
    admitted: Admitted,
) -> list[DueTimer]:
    """``due`` without the timers parked for their key's limit (no query when none is limited).

    Only timers whose attempt was counted for this batch are decided on; a held suspect
    or an uncounted timer is left as it is (the firer deals with them). The others are
    recorded in ``admitted``, whose :meth:`Admitted.settle` the batch calls once it knows
    which of them it ran.
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
    parked = concurrency.admit(db, limits, now_ms, bucket_shift, admitted.from_line)
    admitted.ids.update(timer_id for timer_id in limits if timer_id not in parked)
    due = [timer for timer in due if timer.id not in parked] if parked else due
    if admitted.from_line:
        # In line order: a woken timer made due after a later arrival of its line (both
        # due now) must get the batch's free thread, or its time budget, first.
        place = admitted.from_line
        due = sorted(due, key=lambda t: (place.get(t.id, t.fire_at_ms), t.id))
    return due


def release(
    db: str, specs: Sequence[tuple[int, HandlerSpec]], now_ms: int, bucket_shift: int
) -> list[concurrency.Woken]:
    """After ``(timer id, spec)`` attempts ended: wake the next of their keys' lines."""
    ids = [timer_id for timer_id, spec in specs if spec.concurrency is not None]
    return concurrency.release(db, ids, now_ms, bucket_shift) if ids else []
