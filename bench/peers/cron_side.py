"""durable's side of the schedule benchmark: the handler every benchmark schedule runs.

It lives in its own module (not in ``bench/schedules.py``, which runs as ``__main__``) so
that the engine, looking ``bench.peers.cron_side.stamp`` up by name, finds this module's
recorder rather than a second copy of the script.
"""

from __future__ import annotations

from typing import Any

import durable
from bench._common import Recorder, wall_ms

RECORDER = Recorder()


@durable.handler  # registered: what durable.schedules.create() may name
def stamp(occurrence: Any) -> None:
    """Record ``(scheduled_ms, wall clock now)``: lateness is measured at handler start."""
    RECORDER.events.append((occurrence.scheduled_ms, wall_ms()))
