"""One replay per run in this process, and no wake-up lost to a busy run.

Within one worker, two wake-ups of the same run can be fired at once (a signal arrives
while a sleep ends). :class:`RunGuard` lets one replay run; the other returns at once
and asks the first to go round again. Across workers, the shard lease does that job.
"""

from __future__ import annotations

import threading


class RunGuard:
    """At most one replay per run in this process; a wake-up that finds it busy is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[str, bool] = {}  # run id -> another wake-up came meanwhile
        self._epoch = 0

    @property
    def epoch(self) -> int:
        """How many replays have ended in this process (any run).

        A history read when the epoch was E is still the run's history while the epoch
        is E: nothing that writes histories here has finished since (see
        ``WorkflowKind.resume``, which uses this to skip re-reading a run).
        """
        with self._lock:
            return self._epoch

    def enter(self, run_id: str) -> bool:
        """Take the run; False (and a note to go again) if another thread has it."""
        with self._lock:
            if run_id in self._busy:
                self._busy[run_id] = True
                return False
            self._busy[run_id] = False
            return True

    def again(self, run_id: str) -> bool:
        """True if a wake-up came during the replay (go again); else let the run go."""
        with self._lock:
            self._epoch += 1
            if self._busy.get(run_id):
                self._busy[run_id] = False
                return True
            self._busy.pop(run_id, None)
            return False

    def leave(self, run_id: str, *, replayed: bool = True) -> None:
        """Let the run go (after an error, or after a look that wrote nothing of its own:
        ``replayed=False`` leaves the epoch alone)."""
        with self._lock:
            if replayed:
                self._epoch += 1
            self._busy.pop(run_id, None)
