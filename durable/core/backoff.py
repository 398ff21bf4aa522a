"""Retry delays: exponential, capped, with full jitter.

Full jitter (a uniform draw in ``[0, min(cap, base * 2**n)]``, lower-bounded by half of it)
spreads retries of timers that failed together, so a recovering dependency is not hit by
a synchronized wave. The random source is injected so tests are deterministic.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

#: The longest delay a :class:`Backoff` may have, in seconds (365 days, the bound of every
#: duration setting): retry times stay far inside the 64-bit millisecond columns.
MAX_BACKOFF_S = 365 * 86_400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Retry policy: ``base_s * 2**(attempt-1)`` capped at ``max_s``, jittered to [50%, 100%].

    ``base_s`` and ``max_s`` are finite numbers of seconds with
    ``0 < base_s <= max_s <= MAX_BACKOFF_S`` (365 days).
    """

    base_s: float = 1.0
    max_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("base_s", "max_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"backoff {name}: expected seconds, got {type(value).__name__}")
            if not math.isfinite(value) or not 0 < value <= MAX_BACKOFF_S:
                raise ValueError(
                    f"backoff {name} must be > 0 and <= {MAX_BACKOFF_S:,.0f} s (365 days), "
                    f"got {value!r}"
                )
        if not self.max_s >= self.base_s:
            raise ValueError(f"backoff max_s must be >= base_s, got {self.max_s!r}")

    def delay_ms(self, attempt: int, rng: random.Random | None = None) -> int:
        """Return the delay before retry number ``attempt`` (1 = first retry), in ms.

        Never more than ``max_s`` (so never more than :data:`MAX_BACKOFF_S`), whatever
        ``attempt`` is.
        """
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        ceiling = min(self.max_s, MAX_BACKOFF_S, self.base_s * 2.0 ** min(attempt - 1, 62))
        draw = (rng or random).uniform(0.5, 1.0)
        return max(1, int(ceiling * draw * 1000))
