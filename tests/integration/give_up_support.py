"""Handlers the give-up tests fire: module level, so they have stable dotted names.

Each counts its calls in :data:`CALLS` (in-process tests only), so a test can tell a
handler that was retried from one that was called once.
"""

from __future__ import annotations

from collections import Counter

import durable
from testproject.demo.models import FireRecord

CALLS: Counter[str] = Counter()
FOLLOWUPS: list[dict[str, object]] = []

_ERRORS: dict[str, type[Exception]] = {
    "KeyError": KeyError,
    "ValueError": ValueError,
    "ConnectionError": ConnectionError,
}


@durable.handler(max_attempts=5)
def declines(key: str) -> None:
    """Atomic: writes a row (rolled back with the attempt), then gives up."""
    CALLS[key] += 1
    FireRecord.objects.create(key=key, fired_at_ms=0)
    raise durable.GiveUp(f"card declined for {key} (see /srv/app/payments.py)")


@durable.handler(atomic=False, max_attempts=5)
def declines_outside(key: str) -> None:
    """External: gives up with a cause."""
    CALLS[key] += 1
    raise durable.GiveUp(cause=ValueError(f"no such account {key}"))


@durable.handler(max_attempts=5, give_up_on=(KeyError, ValueError))
def gives_up_on(key: str, error: str) -> None:
    """Atomic, ``give_up_on``: raises ``error`` (a name in ``_ERRORS``)."""
    CALLS[key] += 1
    raise _ERRORS[error](f"{key} in /srv/app/handlers.py")


@durable.handler(atomic=False, max_attempts=5, retry_on=ConnectionError)
def retries_on(key: str, error: str) -> None:
    """External, ``retry_on``: raises ``error`` until its third call, then succeeds."""
    CALLS[key] += 1
    if CALLS[key] < 3:
        raise _ERRORS[error](f"{key} failed")


@durable.handler
def followup(timer_id: int, context: object, result: dict[str, object]) -> None:
    """The ``on_complete`` of a timer: keeps the result it was given."""
    FOLLOWUPS.append({"timer_id": timer_id, **result})


@durable.handler
def record(key: str) -> None:
    """A neighbour: one row per fire."""
    FireRecord.objects.create(key=key, fired_at_ms=0)
