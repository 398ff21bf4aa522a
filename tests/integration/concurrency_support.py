"""Handlers the concurrency-key tests fire: module level, so they have stable dotted names.

``gated`` blocks until its test opens its gate (in-process tests only), so a test decides
when a running attempt ends.
"""

from __future__ import annotations

import threading

import durable
from testproject.demo.models import FireRecord

#: ``n`` of each ``gated`` call, in the order they started.
STARTED: list[int] = []
GATES: dict[int, threading.Event] = {}


def by_account(account: str, n: int) -> str:
    """The concurrency key of a ``gated`` call: its account."""
    return account


@durable.handler(atomic=False, concurrency_key=by_account, max_concurrency=2)
def gated(account: str, n: int) -> None:
    """External; waits (at most 10 s) for its gate, then returns."""
    STARTED.append(n)
    GATES.setdefault(n, threading.Event()).wait(10)


def bad_key(account: str, n: int) -> object:
    """A key callable that returns a non-str for negative ``n`` and raises for zero."""
    if n == 0:
        raise LookupError("no account")
    return account if n > 0 else n


@durable.handler(atomic=False, concurrency_key=bad_key, max_concurrency=1)
def badly_keyed(account: str, n: int) -> None:
    """Never fired: its key callable is what the tests exercise."""


def by_key(key: str, n: int) -> str:
    """The concurrency key of a ``rated`` call."""
    return key


@durable.handler(concurrency_key=by_key, rate_limit="100/s")
def rated(key: str, n: int) -> None:
    """Atomic: one ``FireRecord`` per call, stamped with the batch's time."""
    fire = durable.current_fire()
    assert fire is not None
    FireRecord.objects.create(key=f"{key}:{n}", fired_at_ms=fire.fired_ms)


@durable.handler(atomic=False, concurrency_key=by_account, max_concurrency=1, max_attempts=3)
def fails_first(account: str, n: int) -> None:
    """External; its first attempt for ``n == 1`` raises (a retry after backoff)."""
    STARTED.append(n)
    fire = durable.current_fire()
    if n == 1 and fire is not None and fire.attempt == 1:
        raise ConnectionError("the remote end hung up")


@durable.handler(atomic=False, concurrency_key=by_account, max_concurrency=1)
def gives_up(account: str, n: int) -> None:
    """External; gives up for good (a dead letter at once) when ``n == 1``."""
    STARTED.append(n)
    if n == 1:
        raise durable.GiveUp("the account is closed")
