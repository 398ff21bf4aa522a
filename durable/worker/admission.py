"""The firer's side of concurrency keys: which of a batch's timers a key's limits hold back.

The decision itself is :func:`durable.storage.concurrency.admit`'s, in the batch's
fenced transaction. ``max_concurrency`` binds external handlers (``atomic=False``) only:
an atomic handler starts and finishes inside its batch transaction, on the one thread
that fires its shard, so no two of a key's atomic handlers ever run at once anyway.
``rate_limit`` binds both. A limited workflow's start and retry wake-ups are decided the
same way, by their workflow's limits (:mod:`durable.workflows.slots`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from durable.dispatch.registry import HandlerSpec
from durable.storage import claims, concurrency, run_slots
from durable.storage.firing import DueTimer
from durable.workflows.registry import workflows


@dataclass(slots=True)
class Admitted:
    """A batch's timers admitted by their key's limits (empty when none is limited)."""

    ids: set[int] = field(default_factory=set)
    """Every admitted timer of a limited handler."""
    from_line: dict[int, int] = field(default_factory=dict)
    """Those of them that waited in their key's line, with their place (``queued_ms``)."""
    logs: concurrency.Logs = field(default_factory=concurrency.Logs)
    """The rate logs the decision changed, written by :meth:`settle` (after the handlers
    started: writing them is no part of the time a timer waits for its handler)."""

    def settle(self, db: str, left: set[int], now_ms: int) -> None:
        """The batch ran all but ``left``: see :func:`durable.storage.concurrency.settle`.

        No query when no timer of the batch was admitted by a key; one (the rate logs) when
        none of them waited in line.
        """
        if self.ids:
            started = sorted(set(self.from_line) - left)
            concurrency.settle(db, started, sorted(self.ids & left), now_ms, self.logs)


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
    starts: list[int] = []
    for timer in due:
        if timer.id not in counted.ids or timer.id in counted.held:
            continue
        if timer.kind == "workflow":
            if workflows.limited and _starts_run(timer.key):
                starts.append(timer.id)
            continue
        if timer.kind != "handler":
            continue
        spec = lookup(timer.target)
        policy = None if spec is None else spec.concurrency
        # An atomic handler's attempts never overlap (see the module docstring): only its
        # rate needs deciding.
        if policy is not None and (policy.rate is not None or not spec.atomic):
            limits[timer.id] = (policy.max_concurrency, policy.rate)
    limits.update(_run_limits(db, starts))
    if not limits:
        return due
    parked = concurrency.admit(db, limits, now_ms, bucket_shift, admitted.from_line, admitted.logs)
    admitted.ids.update(timer_id for timer_id in limits if timer_id not in parked)
    due = [timer for timer in due if timer.id not in parked] if parked else due
    if admitted.from_line:
        # In line order: a woken timer made due after a later arrival of its line (both
        # due now) must get the batch's free thread, or its time budget, first.
        place = admitted.from_line
        due = sorted(due, key=lambda t: (place.get(t.id, t.fire_at_ms), t.id))
    return due


def _starts_run(key: str | None) -> bool:
    """A run's start or retry wake-up (``wf:<id>:start...``, ``wf:<id>:retry:...``): the
    only workflow timers that carry a concurrency key (run ids hold no ``:``)."""
    parts = (key or "").split(":", 3)
    return len(parts) > 2 and parts[2] in ("start", "retry")


def _run_limits(db: str, timer_ids: list[int]) -> dict[int, concurrency.Limits]:
    """The limits of the keyed start timers among ``timer_ids``: their workflow's.

    A run whose workflow is not registered here, or no longer limited, is not held back
    (its replay reports an unknown workflow, or it runs).
    """
    limits: dict[int, concurrency.Limits] = {}
    for timer_id, name in run_slots.keyed_starts(db, timer_ids).items():
        definition = workflows.get(name)
        policy = None if definition is None else definition.concurrency
        if policy is not None:
            limits[timer_id] = (policy.max_concurrency, policy.rate)
    return limits


def release(
    db: str, specs: Sequence[tuple[int, HandlerSpec]], now_ms: int, bucket_shift: int
) -> list[concurrency.Woken]:
    """After ``(timer id, spec)`` attempts ended: wake the next of their keys' lines."""
    ids = [timer_id for timer_id, spec in specs if spec.concurrency is not None]
    return concurrency.release(db, ids, now_ms, bucket_shift) if ids else []
