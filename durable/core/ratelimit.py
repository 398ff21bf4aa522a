"""Sliding-window rate limits: at most ``count`` starts in any ``period_ms`` window.

Pure functions over a key's *log*: the times of its last ``count`` starts, oldest
first. A start at ``now`` is allowed while fewer than ``count`` of the logged starts
fall in ``(now - period_ms, now]``. Unlike a token bucket with a burst of ``count``,
this holds over every window, not just on average (a full bucket plus a refill lets
``2 * count - 1`` starts into one window).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_PERIODS_MS = {"s": 1_000, "m": 60_000, "h": 3_600_000}
_SPEC = re.compile(r"(\d+)/([smh])")
#: The most starts a rate may allow per period: the key's row keeps that many times, and
#: rewrites them in every batch that starts one (for more, a shorter period: "1000/s").
MAX_COUNT = 1_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Rate:
    """At most ``count`` starts per ``period_ms``."""

    count: int
    period_ms: int
    text: str
    """As declared, e.g. ``"100/m"``."""

    def room(self, log: list[int], now_ms: int) -> int:
        """How many more starts are allowed at ``now_ms``."""
        since = now_ms - self.period_ms
        return self.count - sum(1 for at in log[-self.count :] if at > since)

    def next_ms(self, log: list[int]) -> int:
        """When the next start is allowed, once the window is full: the oldest logged
        start leaves it."""
        return log[-self.count] + self.period_ms

    def record(self, log: list[int], now_ms: int) -> list[int]:
        """The log after a start at ``now_ms``: the last ``count`` starts, without those
        older than two periods.

        A start older than one period can no longer count in any window from ``now_ms``
        on; the second period is a margin for a decision taken by a clock up to one
        period behind this one (another worker's, after a failover: workers tell time by
        the database's clock, so theirs differ by far less). Dropping them keeps the
        key's row small: at 200/s a key starting 40 timers a second logged 200 starts
        (3 KB of JSON written back by every batch that started one) and now logs about
        80 (bench/concurrency.py).
        """
        kept = [*log, now_ms][-self.count :]
        if kept[0] <= now_ms - 2 * self.period_ms:
            kept = [at for at in kept if at > now_ms - 2 * self.period_ms]
        return kept


def parse_rate(text: object) -> Rate:
    """Parse ``"N/s"``, ``"N/m"`` or ``"N/h"``; ``ValueError``/``TypeError`` naming the problem."""
    if not isinstance(text, str):
        raise TypeError(f"rate_limit: expected a str such as '100/m', got {type(text).__name__}")
    match = _SPEC.fullmatch(text.strip())
    if match is None:
        raise ValueError(
            f"rate_limit: {text!r:.50} is not a rate; write N/s, N/m or N/h (e.g. '100/m')"
        )
    count = int(match.group(1))
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"rate_limit: {text!r}: N must be 1 to {MAX_COUNT}, got {count}")
    return Rate(count=count, period_ms=_PERIODS_MS[match.group(2)], text=text.strip())
