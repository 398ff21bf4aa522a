"""Clocks: the only source of time in durable.

Everything takes a :class:`Clock` and asks it ``now_ms()`` (integer UTC epoch
milliseconds); nothing else calls ``time.time()``. Tests inject
:class:`durable.testing.ManualClock` and move time by hand instead of sleeping.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Protocol

from durable.core.timeutil import ms_to_datetime


class Clock(Protocol):
    """Anything that tells the current time in integer UTC epoch milliseconds."""

    def now_ms(self) -> int:
        """Return the current time as integer UTC epoch milliseconds."""
        ...


class SystemClock:
    """The machine's wall clock, optionally corrected by a measured offset.

    The worker sets ``offset_ms`` to (database clock - local clock) so that it fires by
    database time: a worker whose clock runs fast still never fires early (DESIGN §2).
    """

    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        """Return wall-clock time plus the measured offset, in epoch milliseconds."""
        return time.time_ns() // 1_000_000 + self.offset_ms

    def __repr__(self) -> str:
        return f"SystemClock(offset_ms={self.offset_ms})"


# The process's clock. It lives in this bottom layer (not in the app config) so that the
# scheduling code, the admin and the checks can all read it without importing durable.apps,
# which imports them in turn. Tests swap it with durable.testing.override_clock.
_process_clock: list[Clock] = [SystemClock()]


def current_clock() -> Clock:
    """Return the clock durable's scheduling API, admin and checks read the time from."""
    return _process_clock[0]


def install_clock(clock: Clock) -> Clock:
    """Make ``clock`` the process's clock and return the one it replaces."""
    previous = _process_clock[0]
    _process_clock[0] = clock
    return previous


def current_datetime() -> datetime:
    """Return the process clock's time as an aware UTC datetime (whole milliseconds).

    What an insert without a ``created_at``/``updated_at`` stamps
    (``durable.fields.ClockStampField``), instead of the wall clock Django's
    ``auto_now`` would read.
    """
    return ms_to_datetime(_process_clock[0].now_ms())
