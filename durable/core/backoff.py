"""Retry delays: exponential, capped, with full jitter.

Full jitter (a uniform draw in ``[0, min(cap, base * 2**n)]``, lower-bounded by half of it)
spreads retries of timers that failed together, so a recovering dependency is not hit by
a synchronized wave. The random source is injected so tests are deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Retry policy: ``base_s * 2**(attempt-1)`` capped at ``max_s``, jittered to [50%, 100%]."""

    base_s: float = 1.0
    max_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.base_s > 0:
            raise ValueError(f"backoff base_s must be > 0, got {self.base_s!r}")
        if not self.max_s >= self.base_s:
            raise ValueError(f"backoff max_s must be >= base_s, got {self.max_s!r}")

    def delay_ms(self, attempt: int, rng: random.Random | None = None) -> int:
        """Return the delay before retry number ``attempt`` (1 = first retry), in ms."""
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        ceiling = min(self.max_s, self.base_s * 2.0 ** min(attempt - 1, 62))
        draw = (rng or random).uniform(0.5, 1.0)
        return max(1, int(ceiling * draw * 1000))
