"""Handlers the concurrency-key tests fire: module level, so they have stable dotted names.

``gated`` blocks until its test opens its gate (in-process tests only), so a test decides
when a running attempt ends.
"""

from __future__ import annotations

import threading

import durable

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
