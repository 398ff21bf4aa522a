"""The pre-split of one level's next slot: where a coarse slot's timers wait, already placed.

Splitting a coarse slot when time enters it moves every timer in it at once: a level-3 slot
of a busy shard holds hours of timers, which made one ``advance`` take tens of milliseconds.
So each level ``L >= 1`` keeps a :class:`Stage` for its *next* slot (digit ``now_L + 1``):
the same timers, placed as they will be once time reaches the slot's first tick ``base``,
in rings of their own for levels ``0 .. L-1``. When time enters the slot, the stage's rings
replace the wheel's lower rings (a swap of lists) and nothing moves. The timers that were
in the slot before its stage began (the *source*: the wheel's own slot map) move into the
stage a bounded chunk per ``advance`` (see ``Rings._presplit``); inserts go straight to the
stage once the source is empty.

Moving a chunk must keep each millisecond's insertion order, and a dict only pops cheaply
from its end. So the source is reversed into ``mid`` (``popitem``, last first), and ``mid``
is popped into the stage, which restores the order; inserts that arrive meanwhile wait in
``late`` and follow as the next source. Every timer is in exactly one of source, ``mid``,
``late`` or the stage rings, so cancel still deletes at once, and each step is O(1).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Stage(Generic[K]):
    """Level ``level``'s next slot (``digit``), pre-split relative to its first tick ``base``.

    ``digit`` is -1 while the level has no next slot in its block (the current slot is the
    ring's last; the level above stages what follows). ``rings`` are allocated on first use.
    """

    __slots__ = ("base", "bitmaps", "digit", "due", "late", "level", "mid", "paced_at", "rings")

    def __init__(self, level: int) -> None:
        self.level = level
        self.base = 0
        self.digit = -1
        self.rings: list[list[dict[K, int]]] | None = None
        self.bitmaps = [0] * level
        self.mid: dict[K, int] = {}  # the source reversed, on its way into the rings
        self.late: dict[K, int] = {}  # inserted while a chunked move was under way
        self.paced_at = 0  # tick of the last chunk moved, or of the stage's start
        self.due = 0  # tick at which the next chunk is due

    def allocate(self, slots: int) -> list[list[dict[K, int]]]:
        """Return the stage's rings, creating them (``level`` rings of ``slots``) if needed."""
        if self.rings is None:
            self.rings = [[{} for _ in range(slots)] for _ in range(self.level)]
        return self.rings

    def has_timers(self) -> bool:
        """Whether any timer sits in the stage itself (``mid``, ``late`` or its rings)."""
        return bool(self.mid or self.late or any(self.bitmaps))

    def count(self) -> int:
        """Timers in the stage itself (not its source, which the wheel's ring counts)."""
        total = len(self.mid) + len(self.late)
        if self.rings is not None:
            for ring, bitmap in zip(self.rings, self.bitmaps, strict=True):
                if bitmap:
                    total += sum(len(slot) for slot in ring if slot)
        return total

    def take_rings(self, due: list[K]) -> int:
        """Append the timers of the stage's rings to ``due``; return the slots visited."""
        visits = 0
        if self.rings is not None:
            for ring, bitmap in zip(self.rings, self.bitmaps, strict=True):
                if bitmap:
                    for slot in ring:
                        if slot:
                            due += slot
                            slot.clear()
                            visits += 1
            self.bitmaps = [0] * self.level
        return visits
