"""``schedule(..., key=..., debounce=..., max_wait=...)``: checking the call, reporting refusals.

A debounced call schedules its handler at now + ``debounce`` under ``key``; a later call
with the same key, while that timer is still pending, moves it to its own now +
``debounce`` (never beyond the burst's first call + ``max_wait``) and gives it its own
arguments. The rows are written by :func:`durable.storage.debounce.debounce`, whose
docstring says what happens in each state of the key's row and why concurrent callers
end with one timer. Here: the checks that run before any write, and the errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from durable.exceptions import TimerError
from durable.models import Timer
from durable.scheduling import validation as v
from durable.storage.debounce import Debounced


@dataclass(frozen=True, slots=True, kw_only=True)
class DebouncePolicy:
    """A call's debounce window and bound, in ms (rounded up, so never early)."""

    debounce: timedelta
    debounce_ms: int
    max_wait_ms: int | None


def check(options: dict[str, Any], now_ms: int) -> DebouncePolicy | None:
    """Return the call's policy (None without ``debounce=``); raise naming a bad argument.

    Runs before anything is written. ``options`` are ``schedule()``'s keyword arguments.
    """
    debounce, max_wait = options["debounce"], options["max_wait"]
    if debounce is None:
        if max_wait is not None:
            raise ValueError("max_wait: only means something with debounce=; pass both")
        return None
    debounce_ms = v.check_delay(debounce, now_ms, "debounce", positive=True)
    max_wait_ms = None
    if max_wait is not None:
        max_wait_ms = v.check_delay(max_wait, now_ms, "max_wait", positive=True)
        if max_wait < debounce:
            raise ValueError(
                f"max_wait: {max_wait!r} is shorter than debounce={debounce!r}; the bound "
                "must leave room for at least one debounce window"
            )
    if options["key"] is None:
        raise ValueError("key: debounce= needs a key, which names the timer later calls move")
    if options["at"] is not None or options["delay"] is not None:
        raise ValueError(
            "at/delay: a debounced timer is due at now + debounce; pass neither with debounce="
        )
    if options["parent"] is not None:
        raise ValueError("parent: not supported with debounce=")
    return DebouncePolicy(debounce=debounce, debounce_ms=debounce_ms, max_wait_ms=max_wait_ms)


def timer_or_raise(done: Debounced, key: str) -> Timer:
    """The timer a debounced call left, or the :class:`TimerError` for a refused call."""
    found = done.timer
    if done.outcome == "contended" or found is None:
        raise TimerError(
            f"key: {key!r} kept changing under this call; debounce= needs a READ COMMITTED "
            "transaction (Django's default) to see the other callers' rows",
            key=key,
        )
    if done.outcome == "conflict":
        raise TimerError(
            f"key: {key!r} holds timer {found.pk} ({found.kind} {found.target}); debounce= "
            "only moves a timer of the same handler, so use a key of its own",
            key=key,
            timer=found.pk,
        )
    return found
