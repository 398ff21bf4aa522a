"""The public :class:`TimingWheel`: validation, insert, cancel, advance, metrics."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

from bench.wheel_before.rings import Rings, occupied_slots

K = TypeVar("K", bound=Hashable)


def _as_ms(name: str, value: object) -> int:
    """Return ``value`` as an ``int`` of milliseconds, or raise a TypeError naming ``name``."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{name} must be an int of milliseconds, got {type(value).__name__}")


def _check_setting(name: str, value: object, minimum: int) -> int:
    """Validate one constructor argument: an ``int`` no smaller than ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class TimingWheel(Rings[K]):
    """Hierarchical timing wheel of timer ids, driven by the caller's clock.

    ``TimingWheel(levels=5, slots=256, tick_ms=1, start_ms=0)``: ``slots`` is a power of
    two, ``start_ms`` (the wheel's initial time) is non-negative. Timer ids are any
    hashable; times are integer epoch milliseconds.

    Semantics (each one is tested):

    * **Handles.** :meth:`insert` returns the timer id itself, which is the handle for
      :meth:`cancel`, valid while the timer is pending. Inserting an id that is pending
      raises ``ValueError``: a silent replace would hide a caller's bug, so cancel first, or
      test ``timer_id in wheel``. An id that fired or was cancelled can be inserted again.
    * **Never early.** An id is returned by the first ``advance(now_ms)`` with
      ``now_ms >= fire_at_ms``. With ``tick_ms > 1`` fire times round *up* to a tick, so a
      timer may come out up to ``tick_ms - 1`` ms late, never early.
    * **Overdue inserts.** A timer inserted with ``fire_at_ms`` at or before the wheel's
      time (:attr:`time_ms`) is due: the next ``advance`` returns it, first. (With
      ``tick_ms > 1``: one whose tick has passed; one inside the current tick waits for the
      tick's end like the others, which keeps the order.)
    * **Monotonic time.** ``advance`` with a ``now_ms`` before the wheel's time moves
      nothing and returns only overdue inserts, so a runner whose clock estimate steps back
      keeps working.
    * **Order.** Within one call and across calls, ids come out in fire-time order at 1 ms
      resolution; ids due in the same millisecond come out in insertion order (the order
      of their latest ``insert``). The one inherent exception: an overdue insert comes out
      at the start of the next call, after ids that earlier calls returned.
    * **Cost.** ``insert``, ``cancel`` and ``len`` are O(1). ``advance`` works for the ids
      it returns (sorting the ones that come out of coarse slots), the ids it moves down a
      level and the occupied slots it crosses; it never walks through empty time, so idle
      time costs nothing. Each timer moves down at most ``levels - 1`` times, each move
      exact to the tick. ``cancel`` deletes the entry at once: no tombstone lingers.
    """

    __slots__ = ("_overdue", "_time_ms")

    def __init__(
        self, levels: int = 5, slots: int = 256, tick_ms: int = 1, start_ms: int = 0
    ) -> None:
        _check_setting("levels", levels, 1)
        _check_setting("slots", slots, 2)
        if slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        _check_setting("tick_ms", tick_ms, 1)
        _check_setting("start_ms", start_ms, 0)
        super().__init__(levels, slots.bit_length() - 1, tick_ms, start_ms // tick_ms)
        self._time_ms = start_ms
        self._overdue: dict[K, int] = {}  # inserted with its tick passed -> fire_at_ms

    def __repr__(self) -> str:
        return (
            f"<TimingWheel levels={self._levels} slots={self._mask + 1} tick_ms={self._tick}"
            f" time_ms={self._time_ms} pending={len(self._pending)}>"
        )

    def __len__(self) -> int:
        """Return the number of pending timers, overdue and overflow included."""
        return len(self._pending)

    def __contains__(self, timer_id: object) -> bool:
        """Return whether ``timer_id`` is pending."""
        return timer_id in self._pending

    @property
    def time_ms(self) -> int:
        """The wheel's time: the largest ``now_ms`` advanced to, or ``start_ms``."""
        return self._time_ms

    @property
    def spans_ms(self) -> tuple[int, ...]:
        """Time covered by each level's whole ring, in ms (256 ms to 34.8 y by default)."""
        slots = self._mask + 1
        return tuple(self._tick * slots ** (level + 1) for level in range(self._levels))

    @property
    def cascades(self) -> int:
        """Timer moves from one level down to a lower one since creation (a metric)."""
        return self._cascaded

    @property
    def slot_visits(self) -> int:
        """Non-empty slots (and overflow passes) processed since creation (a metric)."""
        return self._slot_visits

    @property
    def overflow_reentries(self) -> int:
        """Timers moved from the overflow back into the rings since creation (a metric)."""
        return self._reentered

    def pending_per_level(self) -> tuple[int, ...]:
        """Return the number of timers in each level's ring, level 0 first."""
        return tuple(
            sum(map(len, occupied_slots(ring, bitmap, 0, len(ring))))
            for ring, bitmap in zip(self._slots, self._bitmaps, strict=True)
        )

    def pending_overflow(self) -> int:
        """Return the number of timers beyond the top level, waiting in the overflow."""
        return len(self._overflow)

    def pending_overdue(self) -> int:
        """Return the number of timers inserted already due, waiting for the next advance."""
        return len(self._overdue)

    def next_expiry(self) -> int | None:
        """Return the ms at which the next non-empty slot comes due, or None when empty.

        Nothing is due before it, so a runner may sleep until then. It is a lower bound, not
        always a fire time: a coarse slot comes due when its timers must move down, so a
        timer can cause up to ``levels - 1`` wake-ups that return no id. With overdue
        inserts waiting, it is the wheel's time.
        """
        if self._overdue:
            return self._time_ms
        bits = self._bits
        for level, bitmap in enumerate(self._bitmaps):
            if bitmap:
                shift = level * bits
                digit = (bitmap & -bitmap).bit_length() - 1
                base = self._now >> (shift + bits) << (shift + bits)
                return (base | digit << shift) * self._tick
        if self._overflow:
            return self._overflow_block_start() * self._tick
        return None

    def insert(self, timer_id: K, fire_at_ms: int) -> K:
        """Schedule ``timer_id`` at ``fire_at_ms``; return its handle (the id itself). O(1).

        Raises ValueError if ``timer_id`` is already pending.
        """
        pending = self._pending
        if timer_id in pending:
            raise ValueError(f"timer {timer_id!r} is already pending; cancel it first")
        if type(fire_at_ms) is not int:
            fire_at_ms = _as_ms("fire_at_ms", fire_at_ms)
        tick = self._tick
        t = fire_at_ms if tick == 1 else -(-fire_at_ms // tick)  # round up: never early
        if t <= self._now:
            self._overdue[timer_id] = fire_at_ms
        else:
            n = (t ^ self._now).bit_length()
            if n < len(self._level_of):
                level = self._level_of[n]
                digit = t >> (level * self._bits) & self._mask
                slot = self._slots[level][digit]
                if not slot:
                    self._bitmaps[level] |= self._powers[digit]
                slot[timer_id] = t
            else:
                self._to_overflow(timer_id, t)
        pending[timer_id] = fire_at_ms
        return timer_id

    def cancel(self, handle: K) -> bool:
        """Cancel a pending timer; return False if it already fired or was cancelled. O(1).

        The entry is deleted at once, and a slot left empty gives its table back.
        """
        fire_at_ms = self._pending.pop(handle, None)
        if fire_at_ms is None:
            return False
        tick = self._tick
        t = fire_at_ms if tick == 1 else -(-fire_at_ms // tick)
        if t <= self._now:  # every tick up to _now has fired, so it is waiting as overdue
            del self._overdue[handle]
            return True
        n = (t ^ self._now).bit_length()  # the invariant locates the slot: nothing stored
        if n >= len(self._level_of):
            del self._overflow[handle]
            if t == self._overflow_min or not self._overflow:
                self._overflow_min = None
            return True
        level = self._level_of[n]
        digit = t >> (level * self._bits) & self._mask
        slot = self._slots[level][digit]
        del slot[handle]
        if not slot:
            slot.clear()  # a dict keeps its table after del; clear() releases it
            self._bitmaps[level] ^= self._powers[digit]
        return True

    def advance(self, now_ms: int) -> list[K]:
        """Move the wheel's time to ``now_ms``; return the ids now due, in fire-time order.

        Overdue inserts come first. A ``now_ms`` before the wheel's time moves nothing.
        """
        if type(now_ms) is not int:
            now_ms = _as_ms("now_ms", now_ms)
        out: list[K] = self._take_overdue() if self._overdue else []
        if now_ms > self._time_ms:
            self._time_ms = now_ms
            target = now_ms if self._tick == 1 else now_ms // self._tick
            if target > self._now:
                self._jump(target, out)
        pending = self._pending
        for timer_id in out:
            del pending[timer_id]
        return out

    def _take_overdue(self) -> list[K]:
        """Return the overdue inserts by fire time; the sort is stable, so ties keep order."""
        overdue = self._overdue
        due = sorted(overdue, key=overdue.__getitem__)
        overdue.clear()
        return due
