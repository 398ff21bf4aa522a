"""Timer kinds: how the firer turns a timer's ``target`` into something to call.

Plain timers (kind ``handler``) resolve through the handler registry. Other capabilities
(cron occurrences, workflow wake-ups, Celery publishes) register a resolver for their kind
when their module is imported, and the firer dispatches on ``Timer.kind`` without knowing
about them. A resolver returns a :class:`~durable.dispatch.registry.HandlerSpec`; the
firer calls ``spec.fn(*timer.args, **timer.kwargs)``, inside the batch transaction when
``spec.atomic``.

A kind may also register a *batch scope* (:func:`register_batch_scope`): a context
manager the firer enters around the handlers of a batch on its fast path, given the
batch's timers of that kind and the :class:`FiringBatch`, so that work common to them
(cron's locked read of its schedule rows, say) is done once per batch instead of once
per timer. A scope may also claim its kind's external timers itself, in a statement it
runs anyway (the workflow kind marks their runs running in it), and say so in
``FiringBatch.claimed``. Inside a scope a
handler may skip its own savepoint and raise :class:`RedoCarefully` when it fails: the
firer then rolls the batch back and runs it again one timer at a time, each in a
savepoint, outside any scope.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from durable.dispatch.registry import HandlerSpec, handlers


@dataclass(slots=True, kw_only=True)
class FiringBatch:
    """What a batch scope is told of its batch, and what it tells the firer back."""

    now_ms: int
    """The batch's time: what judged its timers due."""
    claim_until_ms: int
    """Until when an external timer claimed in this batch stays claimed."""
    tokens: dict[int, int] = field(default_factory=dict)
    """Shard → the lease token the batch runs under (a claim records its shard's)."""
    sent: set[int] = field(default_factory=set)
    """Timers the firer sends to the executor after commit (set before the scopes exit);
    a scope claims none but these."""
    claimed: set[int] = field(default_factory=set)
    """Timers a scope claimed itself, as :func:`durable.storage.firing.claim` does: the
    firer does not claim them again."""
    only_claims: bool = False
    """Set by the firer after the handlers ran, before the scopes exit: the batch fired
    nothing in its transaction and ``ASYNC_COMMIT`` is on, so its claims may commit
    asynchronously (see :func:`durable.storage.firing.claim`)."""


Resolver = Callable[[str], HandlerSpec]
#: ``scope(db, timers of the kind in the batch, batch)`` → a context manager.
BatchScope = Callable[[str, Sequence[Any], FiringBatch], AbstractContextManager[None]]

_resolvers: dict[str, Resolver] = {"handler": handlers.resolve}


class RedoCarefully(Exception):
    """Raised by a handler on a batch's fast path: redo the batch one timer at a time.

    Unlike any other exception from a handler, it does not count as a failure of the
    timer: in the careful redo the handler runs again, in a savepoint, and decides for
    itself what its failure means (cron records it on the schedule, say).
    """


_scopes: dict[str, BatchScope] = {}

#: ``hook(db, timer, error, now_ms)``, called in the transaction that dead-letters a
#: timer of its kind.
DeadLetterHook = Callable[[str, Any, str, int], None]
_dead_letter_hooks: dict[str, DeadLetterHook] = {}


def register_kind(kind: str, resolver: Resolver) -> None:
    """Make timers of ``kind`` fire through ``resolver`` (called once per fire)."""
    _resolvers[kind] = resolver


def resolvers() -> dict[str, Resolver]:
    """Return a copy of the kind → resolver table."""
    return dict(_resolvers)


def register_batch_scope(kind: str, scope: BatchScope) -> None:
    """Enter ``scope`` around a batch's handlers when the batch holds timers of ``kind``."""
    _scopes[kind] = scope


def register_dead_letter(kind: str, hook: DeadLetterHook) -> None:
    """Call ``hook`` when a timer of ``kind`` is dead-lettered (in that transaction).

    For kinds whose timers stand for something else that must not wait for ever: the
    workflow kind fails the run whose wake-up timer used up its attempts.
    """
    _dead_letter_hooks[kind] = hook


def dead_lettered(db: str, timer: Any, error: str, now_ms: int) -> None:
    """Tell ``timer``'s kind it was dead-lettered with ``error`` (see
    :func:`register_dead_letter`)."""
    hook = _dead_letter_hooks.get(timer.kind)
    if hook is not None:
        hook(db, timer, error, now_ms)


@contextmanager
def batch_scopes(db: str, timers: Sequence[Any], batch: FiringBatch) -> Iterator[None]:
    """Enter the registered scope of every kind present in ``timers`` (a firing batch)."""
    with ExitStack() as stack:
        for kind, scope in _scopes.items():
            mine = [timer for timer in timers if timer.kind == kind]
            if mine:
                stack.enter_context(scope(db, mine, batch))
        yield
