"""The wheel's storage and the moves time makes on it: draining, taking and splitting slots.

:class:`Rings` holds the slot maps, the occupancy bitmaps and the overflow;
:class:`~durable.core.wheel.staging.StagedRings` adds the stages and the jump to a later
tick, and :class:`~durable.core.wheel.timing_wheel.TimingWheel` the public API. The
placement invariant this code keeps is stated in the package docstring.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


def occupied_slots(
    ring: list[dict[K, int]], selected: int, lo: int, hi: int
) -> Iterable[dict[K, int]]:
    """Return the non-empty slots of ``ring[lo:hi]``, whose digits are the bits of ``selected``.

    A short or well-filled range is scanned by ``filter`` at C speed; a sparse one over a
    large ring walks the set bits, so the cost never grows with the number of empty slots.
    """
    if selected.bit_count() * 8 >= hi - lo:
        return filter(None, ring[lo:hi])
    slots = []
    while selected:
        low = selected & -selected
        slots.append(ring[low.bit_length() - 1])
        selected ^= low
    return slots


class Rings(Generic[K]):
    """Slot maps, bitmaps and overflow of a timing wheel, and the jump to a later tick."""

    __slots__ = (
        "_bitmaps",
        "_bits",
        "_cascaded",
        "_level_of",
        "_levels",
        "_mask",
        "_now",
        "_overflow",
        "_overflow_min",
        "_pending",
        "_powers",
        "_reentered",
        "_slot_visits",
        "_slots",
        "_tick",
    )

    def __init__(self, levels: int, bits: int, tick_ms: int, now: int) -> None:
        slots = 1 << bits
        self._bits = bits
        self._mask = slots - 1
        self._levels = levels
        self._tick = tick_ms
        self._now = now  # current tick: every timer due at or before it has been returned
        # _level_of[n]: level of a tick differing from _now in its n low bits (n past the
        # end: overflow). A table lookup is cheaper than a division on the insert path.
        self._level_of = [max(n - 1, 0) // bits for n in range(bits * levels + 1)]
        self._powers = [1 << digit for digit in range(slots)]
        self._slots: list[list[dict[K, int]]] = [[{} for _ in range(slots)] for _ in range(levels)]
        self._bitmaps = [0] * levels  # bit d set <=> slot d of that level is non-empty
        self._pending: dict[K, int] = {}  # every pending id -> fire_at_ms as given
        self._overflow: dict[K, int] = {}  # timers beyond the top level -> tick
        self._overflow_min: int | None = None  # smallest tick in _overflow; None: recompute
        self._cascaded = 0
        self._reentered = 0
        self._slot_visits = 0

    def _to_overflow(self, timer_id: K, t: int) -> None:
        """Park a timer beyond the top level, keeping the cached minimum when it is cheap."""
        if not self._overflow or (self._overflow_min is not None and t < self._overflow_min):
            self._overflow_min = t
        self._overflow[timer_id] = t

    def _overflow_block_start(self) -> int:
        """Return the tick at which the earliest overflow timer's top-level block starts."""
        if self._overflow_min is None:
            self._overflow_min = min(self._overflow.values())
        top = self._bits * self._levels
        return self._overflow_min >> top << top

    def _drain_level0(self, now: int, last: int, out: list[K]) -> None:
        """Append level 0's timers after tick ``now`` up to ``last`` (same ring), in order."""
        bitmaps = self._bitmaps
        mask = self._mask
        last_digit = last & mask
        # Occupied digits all come after now's, so clearing the bits above last's selects.
        selected = bitmaps[0] & ((2 << last_digit) - 1)
        if not selected:
            return
        bitmaps[0] ^= selected
        if not selected & (selected - 1):  # one slot: the usual case for a runner that
            slot = self._slots[0][selected.bit_length() - 1]  # wakes at each fire time
            self._slot_visits += 1
            out += slot if self._tick == 1 else sorted(slot, key=self._pending.__getitem__)
            slot.clear()
            return
        self._slot_visits += selected.bit_count()
        slots = occupied_slots(self._slots[0], selected, (now & mask) + 1, last_digit + 1)
        if self._tick == 1:
            for slot in slots:
                out += slot  # one ms per slot: keys are already in insertion order
                slot.clear()
        else:
            key = self._pending.__getitem__
            for slot in slots:
                out += sorted(slot, key=key)  # a tick spans several ms: order them
                slot.clear()

    def _take_slots(self, level: int, end_digit: int, due: list[K]) -> None:
        """Append (unordered) every timer of ``level``'s slots before ``end_digit``."""
        bitmap = self._bitmaps[level]
        selected = bitmap & ((1 << end_digit) - 1)
        if not selected:
            return
        self._bitmaps[level] = bitmap ^ selected
        self._slot_visits += selected.bit_count()
        for slot in occupied_slots(self._slots[level], selected, 0, end_digit):
            due += slot
            slot.clear()

    def _split_overflow(self, target: int, due: list[K]) -> None:
        """Bring the overflow timers due by ``target`` or in its top-level block back in.

        One pass over the overflow, only when ``target`` reaches the earliest one's block:
        at most once per top-level span (34.8 years by default) in steady operation.
        """
        if self._overflow_block_start() > target:
            return
        top = self._bits * self._levels
        block = target >> top
        overflow = self._overflow
        entering = {i: t for i, t in overflow.items() if t >> top <= block}
        for timer_id in entering:
            del overflow[timer_id]
        self._overflow_min = min(overflow.values()) if overflow else None
        self._slot_visits += 1
        self._reentered += self._split_slot(entering, self._levels - 1, target, due)

    def _split_slot(self, src: dict[K, int], lower: int, target: int, due: list[K]) -> int:
        """Append ``src``'s timers due by ``target``; move the rest to ``lower`` or below.

        ``src`` shares every digit above ``lower`` with ``target``, and the rings up to
        ``lower`` are empty. A timer whose ``lower`` digit differs from target's belongs to
        ``lower``; the rare one whose digit matches goes deeper. Returns how many moved.
        """
        shift = lower * self._bits
        mask = self._mask
        target_digit = target >> shift & mask
        ring = self._slots[lower]
        occupied = 0
        moved = len(src)
        deeper: list[tuple[K, int]] | None = None
        for timer_id, t in src.items():
            if t <= target:
                due.append(timer_id)
                moved -= 1
                continue
            digit = t >> shift & mask
            if digit == target_digit:
                if deeper is None:
                    deeper = []
                deeper.append((timer_id, t))
                continue
            slot = ring[digit]
            if not slot:  # one int OR per newly filled slot, not one per timer
                occupied |= self._powers[digit]
            slot[timer_id] = t
        self._bitmaps[lower] |= occupied
        if deeper:
            self._place_all(deeper)
        return moved

    def _place_all(self, timers: Iterable[tuple[K, int]]) -> None:
        """Place timers that are due after ``_now`` in the rings (never the overflow)."""
        now = self._now
        bits = self._bits
        mask = self._mask
        level_of = self._level_of
        slots = self._slots
        bitmaps = self._bitmaps
        powers = self._powers
        for timer_id, t in timers:
            level = level_of[(t ^ now).bit_length()]
            digit = t >> (level * bits) & mask
            slot = slots[level][digit]
            if not slot:
                bitmaps[level] |= powers[digit]
            slot[timer_id] = t
