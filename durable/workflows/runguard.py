"""One replay per run in this process, no wake-up lost to a busy run, and handovers.

Within one worker, two wake-ups of the same run can be fired at once (a signal arrives
while a sleep ends). :class:`RunGuard` lets one replay run; the other returns at once
and asks the first to go round again. Across workers, the shard lease does that job.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from durable.storage.checkpoints import RunSnapshot


class RunGuard:
    """At most one replay per run in this process; a wake-up that finds it busy is kept."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: dict[str, bool] = {}  # run id -> another wake-up came meanwhile

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
            if self._busy.get(run_id):
                self._busy[run_id] = False
                return True
            self._busy.pop(run_id, None)
            return False

    def leave(self, run_id: str) -> None:
        """Let the run go (after an error)."""
        with self._lock:
            self._busy.pop(run_id, None)


class Handovers:
    """Histories a firing batch read for the executor's replays of their runs.

    The batch offers them before it commits (it holds the runs' guards and row locks)
    and confirms them once committed. The first replay of a run to start afterwards
    takes its entry, whatever it holds: a confirmed history is still the run's, since no
    replay of it has run since the read (one would have taken the entry); an unconfirmed
    one (a replay started before the commit, or the batch rolled back) is dropped, and the
    replay reads the run itself.
    """

    LIMIT = 100_000  # entries whose timers never reached a replay (a batch rolled back)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[RunSnapshot, object, bool]] = {}

    def offer(self, snapshots: dict[str, RunSnapshot]) -> object:
        """Keep ``snapshots`` unconfirmed; return the token that confirms them."""
        token = object()
        with self._lock:
            if len(self._entries) > self.LIMIT:
                self._entries.clear()
            for run_id, snapshot in snapshots.items():
                self._entries[run_id] = (snapshot, token, False)
        return token

    def confirm(self, run_ids: list[str], token: object) -> None:
        """The batch that offered these committed: their entries may be used."""
        with self._lock:
            for run_id in run_ids:
                entry = self._entries.get(run_id)
                if entry is not None and entry[1] is token:
                    self._entries[run_id] = (entry[0], token, True)

    def take(self, run_id: str) -> RunSnapshot | None:
        """Remove the run's entry; its history if confirmed."""
        with self._lock:
            entry = self._entries.pop(run_id, None)
        return entry[0] if entry is not None and entry[2] else None

    def discard(self, run_id: str) -> None:
        """Drop the run's entry (the run ended inside a batch)."""
        with self._lock:
            self._entries.pop(run_id, None)
