"""What a running handler can learn about the fire that called it.

``durable.current_fire()`` returns a :class:`FireContext` inside a handler and ``None``
elsewhere. External (``atomic=False``) handlers are at-least-once: use
``current_fire().idempotency_key`` to make their outside effects idempotent — it is the
same on every attempt and every re-run after a crash.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class FireContext:
    """The timer being fired: id, key, attempt number and times, in epoch ms."""

    timer_id: int
    key: str | None
    attempt: int
    """1 for the first attempt, 2 for the first retry, and so on."""
    scheduled_ms: int
    """When the timer was due."""
    fired_ms: int
    """When this attempt started, by the worker's (database-corrected) clock."""
    shard: int | None = None
    """The shard the timer belongs to."""
    token: int | None = None
    """The lease token the worker held when it took the timer: code that commits its own
    transactions (workflow replay) passes it to ``durable.storage.leases.fence``."""
    metrics: Any = field(default=None, repr=False, compare=False)
    """The worker's :class:`durable.metrics.WorkerMetrics`, for code that times its own
    work (workflow steps); ``None`` outside a worker."""

    completed: list[bool] = field(default_factory=list, repr=False, compare=False)
    """Non-empty once an external handler marked its own timer fired, in its last
    transaction (:func:`durable.storage.firing.complete_claim`): the firer then has
    nothing left to complete."""

    @property
    def idempotency_key(self) -> str:
        """A key stable across retries and re-runs of this timer: ``"durable:timer:<id>"``."""
        return f"durable:timer:{self.timer_id}"


_current: ContextVar[FireContext | None] = ContextVar("durable_fire", default=None)


def current_fire() -> FireContext | None:
    """Return the :class:`FireContext` of the handler running now, or ``None``."""
    return _current.get()


def enter_fire(ctx: FireContext) -> Token[FireContext | None]:
    """Make ``ctx`` current until :func:`leave_fire` (what :func:`firing` does, without a
    context manager: the worker's fire loop calls it once per handler)."""
    return _current.set(ctx)


def leave_fire(token: Token[FireContext | None]) -> None:
    """Undo the :func:`enter_fire` that returned ``token``."""
    _current.reset(token)


@contextmanager
def firing(ctx: FireContext) -> Iterator[FireContext]:
    """Make ``ctx`` current for the duration of a handler call."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
