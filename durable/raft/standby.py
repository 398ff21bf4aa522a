"""A follower's standby wheel: the shard's pending timers, kept warm, never fired.

Fed by the Raft log a shard's owner replicates (:mod:`durable.raft.state`), it holds what
the owner's wheel holds. When this node becomes the owner, :meth:`StandbyWheel.overdue`
gives the ids already due, which the worker fires at once while its usual rebuild from
the rows runs. A stale entry (fired or cancelled meanwhile) costs nothing: every fire is
fenced and re-checks the row's state, so it can neither fire twice nor fire early.
"""

from __future__ import annotations

from collections.abc import Iterable

from durable.core.wheel import TimingWheel


class StandbyWheel:
    """A :class:`TimingWheel` of ``(id, fire_at_ms)`` that only says what is due."""

    def __init__(self, start_ms: int = 0) -> None:
        self.wheel: TimingWheel[int] = TimingWheel(start_ms=start_ms)
        # Ids the wheel already gave out as due: kept (not fired) until the log removes
        # them or this node takes the shard over.
        self.due: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.wheel) + len(self.due)

    def add(self, timer_id: int, fire_at_ms: int) -> None:
        """Track a pending timer (a re-add moves it to its new fire time)."""
        self.remove(timer_id)
        self.wheel.insert(timer_id, fire_at_ms)

    def remove(self, timer_id: int) -> None:
        """Forget a timer (fired, cancelled, or moved to another time)."""
        if not self.wheel.cancel(timer_id):
            self.due.pop(timer_id, None)

    def reset(self, items: Iterable[tuple[int, int]], now_ms: int) -> None:
        """Replace everything (after a Raft snapshot was installed)."""
        self.wheel = TimingWheel(start_ms=max(0, now_ms))
        self.due = {}
        for timer_id, fire_at in items:
            self.add(timer_id, fire_at)

    def overdue(self, now_ms: int) -> list[tuple[int, int]]:
        """The timers due at ``now_ms``, oldest first, as ``(id, due_by_ms)``; they stay
        tracked until removed. ``due_by_ms`` is the time they were found due, not their
        exact fire time (the wheel does not keep it once it gives them out): the fire
        reads the row's own time, this only orders them."""
        for timer_id in self.wheel.advance(now_ms) if len(self.wheel) else []:
            self.due[timer_id] = now_ms
        return list(self.due.items())
