"""The soak bench's handler (``bench/soak.py``): does nothing and keeps nothing.

Its own module, so that an hour of fires in the worker leaves no samples in memory (the
timer bench's handlers append every fire to a recorder); lateness is read from the rows.
"""

from __future__ import annotations

import durable


@durable.handler
def idle() -> None:
    """Fire and forget: the soak measures the rows' ``fired_at``, not the handler."""


IDLE = "bench.peers.soak_side.idle"
