"""Helpers for testing code that uses durable: a manual clock, a way to install it, and
time travel with the real engine (:func:`time_machine`, the ``durable_time_machine``
pytest fixture; see ``docs/how-to/testing.md``).

``time_machine``, ``TimeMachine`` and ``Trip`` are imported lazily (they need Django and
the engine); ``ManualClock`` and ``override_clock`` need neither.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

__all__ = ["ManualClock", "TimeMachine", "Trip", "override_clock", "time_machine"]

_TRAVEL = ("TimeMachine", "Trip", "time_machine")


def __getattr__(name: str) -> Any:
    # Lazily: durable.testing.travel imports the engine, hence Django's settings.
    if name in _TRAVEL:
        from durable.testing import travel

        return getattr(travel, name)
    raise AttributeError(f"module 'durable.testing' has no attribute {name!r}")


class ManualClock:
    """A clock that only moves when told to; inject it instead of sleeping in tests.

    >>> clock = ManualClock(start_ms=1_000)
    >>> clock.advance(timedelta(seconds=2)); clock.now_ms()
    3000
    """

    def __init__(self, start_ms: int = 0) -> None:
        self._now_ms = int(start_ms)

    def now_ms(self) -> int:
        """Return the clock's current time in epoch milliseconds."""
        return self._now_ms

    def advance(self, delta: timedelta | int) -> int:
        """Move forward by a ``timedelta`` or a number of milliseconds; return the new time."""
        ms = _to_ms(delta)
        if ms < 0:
            raise ValueError(f"ManualClock.advance() needs a non-negative delta, got {delta!r}")
        self._now_ms += ms
        return self._now_ms

    def set(self, when: datetime | int) -> None:
        """Jump to an aware ``datetime`` or epoch milliseconds (never backwards)."""
        if isinstance(when, datetime):
            if when.tzinfo is None:
                raise ValueError("ManualClock.set() needs an aware datetime, got a naive one")
            target = int(when.timestamp() * 1000)
        else:
            target = int(when)
        if target < self._now_ms:
            raise ValueError(f"ManualClock.set() cannot move backwards ({target} < {self._now_ms})")
        self._now_ms = target

    def __repr__(self) -> str:
        return f"ManualClock(now_ms={self._now_ms})"


def _to_ms(delta: timedelta | int) -> int:
    if isinstance(delta, timedelta):
        return int(delta.total_seconds() * 1000)
    return int(delta)


@contextmanager
def override_clock(clock: Any) -> Iterator[Any]:
    """Make ``clock`` the clock durable's scheduling API reads, for the ``with`` block."""
    from durable.core.clock import install_clock

    previous = install_clock(clock)
    try:
        yield clock
    finally:
        install_clock(previous)
