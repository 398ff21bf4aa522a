"""The jump to a later tick, and the stages that keep it bounded (issue 16).

:class:`StagedRings` adds to :class:`~durable.core.wheel.rings.Rings` one
:class:`~durable.core.wheel.stage.Stage` per level, which prepares the level's next slot a
paced chunk per ``advance``, and the jump that enters a prepared slot by swapping rings.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TypeVar

from durable.core.wheel.rings import Rings
from durable.core.wheel.stage import Stage

K = TypeVar("K", bound=Hashable)

#: Floor of a paced pre-split chunk. Smaller chunks spread the work thinner, but each call
#: that moves some costs about what 10-20 moves do: at 16, a drain spent 30% more CPU per
#: timer than at 64. 64 shards crossing one boundary together move 64 x 64 per turn.
MIN_CHUNK = 64
#: The lowest level with a stage. A level-1 slot holds one level-0 ring of time (256 ms by
#: default), all of it due within that long after time enters it: splitting it then is
#: work for timers about to fire, while staging it would cost every timer two more moves.
FIRST_STAGED = 2
#: A source this small (and within the budget) is moved when its stage starts: one pass,
#: cheaper than the call a planned chunk costs; 64 shards crossing together move at most
#: 64 x 32 timers at once.
SMALL_SOURCE = 32
NEVER = 1 << 128  # a tick no clock reaches: no chunk is due


class StagedRings(Rings[K]):
    """Rings whose coarse slots are prepared ahead of time; the jump that uses them."""

    __slots__ = ("_budget", "_chunk_at", "_next", "_stages")

    def __init__(self, levels: int, bits: int, tick_ms: int, now: int, budget: int) -> None:
        super().__init__(levels, bits, tick_ms, now)
        self._budget = budget  # timer moves one advance may spend on pre-splits
        # _stages[L] pre-splits level L's next slot (L >= 1); _next[L] is that slot's digit,
        # or -1 (no stage: level 0, or the current slot is the ring's last).
        self._stages: list[Stage[K]] = [Stage(level) for level in range(levels)]
        self._next = [-1] * levels
        self._chunk_at = NEVER  # tick at which some stage's next chunk is due
        self._restage(levels - 1)

    def _jump(self, target: int, out: list[K]) -> None:
        """Move to tick ``target``: append every timer due by then to ``out``, in order.

        With ``top`` the highest level at which ``target``'s digit differs from now's: every
        slot below ``top`` is entirely due, and so are their stages; at ``top``, the slots
        before target's digit are due. If target lies in ``top``'s next slot, its stage is
        finished (what is left of the source) and *entered*: its rings become the lower
        rings, time moves to the slot's first tick, and the jump goes on from there, now
        below ``top``. Otherwise target's own slot is split (due part out, the rest moved
        down, relative to ``target``). Everything above ``top`` is already placed right for
        ``target``. Earlier levels hold earlier timers, so level 0 (one tick per slot) goes
        out first as is and the rest is sorted once; equal fire times share a slot map and
        the sort is stable, so ties keep insertion order.
        """
        now = self._now
        top = ((target ^ now).bit_length() - 1) // self._bits
        if self._bitmaps[0]:
            self._drain_level0(now, target if top == 0 else now | self._mask, out)
        self._now = target
        if top == 0:
            return
        due: list[K] = []
        levels = self._levels
        stages = self._stages
        for level in range(1, min(top, levels)):
            if stages[level].digit >= 0:
                self._take_stage(stages[level], due)
            if self._bitmaps[level]:
                self._take_slots(level, self._mask + 1, due)
        if top < levels:
            stage = stages[top]
            digit = target >> (top * self._bits) & self._mask
            if digit == stage.digit and (self._bitmaps[top] >> digit & 1 or stage.has_timers()):
                self._enter(stage, target, due, out)
                return
            if stage.digit >= 0:  # (an empty next slot is not worth entering)
                self._take_stage(stage, due)
            if self._bitmaps[top] & ((1 << digit) - 1):  # whole slots before target's: due
                self._take_slots(top, digit, due)
            bitmap = self._bitmaps[top]
            if bitmap >> digit & 1:
                self._bitmaps[top] = bitmap ^ self._powers[digit]
                self._slot_visits += 1
                slot = self._slots[top][digit]
                self._cascaded += self._split_slot(slot, top - 1, target, due)
                slot.clear()
        elif self._overflow:
            self._split_overflow(target, due)
        if due:
            if len(due) > 1:
                due.sort(key=self._pending.__getitem__)
            out += due
        if top >= FIRST_STAGED:
            self._restage(min(top, levels - 1))

    def _enter(self, stage: Stage[K], target: int, due: list[K], out: list[K]) -> None:
        """Time enters ``stage``'s slot: swap its rings in, then go on to ``target``.

        ``due`` holds the timers before the slot (all due); the lower rings are empty.
        """
        if stage.mid or stage.late or self._bitmaps[stage.level] >> stage.digit & 1:
            self._presplit(stage, -1)  # what pacing left: the caller advanced too seldom
        if due:
            if len(due) > 1:
                due.sort(key=self._pending.__getitem__)
            out += due
        rings = stage.rings
        if rings is not None:
            bitmaps = stage.bitmaps
            for level in range(stage.level):
                self._slots[level], rings[level] = rings[level], self._slots[level]
                self._bitmaps[level], bitmaps[level] = bitmaps[level], 0
        self._now = base = stage.base
        self._restage(stage.level)
        if self._bitmaps[0] & 1:  # due at the slot's very first tick
            self._bitmaps[0] ^= 1
            self._slot_visits += 1
            slot = self._slots[0][0]
            out += slot if self._tick == 1 else sorted(slot, key=self._pending.__getitem__)
            slot.clear()
        if target > base:
            self._jump(target, out)

    def _restage(self, upto: int) -> None:
        """Point the (empty) stages of levels up to ``upto`` at their next slot from now."""
        if upto < FIRST_STAGED:
            return  # the usual jump (over a level-1 boundary) leaves every stage as it was
        now = self._now
        bits = self._bits
        mask = self._mask
        sources = 0
        small = min(SMALL_SOURCE, self._budget)
        for level in range(FIRST_STAGED, upto + 1):
            stage = self._stages[level]
            shift = level * bits
            digit = (now >> shift & mask) + 1
            if digit > mask:
                stage.digit = self._next[level] = -1
                continue
            stage.digit = self._next[level] = digit
            stage.base = ((now >> shift) + 1) << shift
            stage.paced_at = now
            source = self._slots[level][digit]
            if len(source) <= small:  # cheaper moved now than planned (and order kept)
                if source:
                    self._presplit(stage, len(source))
            else:
                sources = 1
        if sources:  # (a plan of a stage restaged here is stale: a call to it re-plans)
            self._schedule_chunks()

    def _take_stage(self, stage: Stage[K], due: list[K]) -> None:
        """Append every timer of a passed stage and its source, ties in insertion order.

        That order is: the stage's rings (earlier rounds), the source, ``mid`` reversed
        (the source's end, popped last first), then ``late``.
        """
        if stage.digit < 0:
            return
        self._slot_visits += stage.take_rings(due)
        source = self._slots[stage.level][stage.digit]
        if source:
            due += source
            source.clear()
            self._bitmaps[stage.level] ^= self._powers[stage.digit]
            self._slot_visits += 1
        if stage.mid:
            due += reversed(stage.mid)
            stage.mid.clear()
        if stage.late:
            due += stage.late
            stage.late.clear()

    def _stage_place(self, stage: Stage[K], timer_id: K, t: int) -> None:
        """Put a timer of ``stage``'s slot where it goes once time reaches the slot."""
        rings = stage.rings if stage.rings is not None else stage.allocate(self._mask + 1)
        level = self._level_of[(t ^ stage.base).bit_length()]
        digit = t >> (level * self._bits) & self._mask
        slot = rings[level][digit]
        if not slot:
            stage.bitmaps[level] |= self._powers[digit]
        slot[timer_id] = t

    def _place_all_staged(self, stage: Stage[K], timers: dict[K, int]) -> None:
        """Place every timer of ``timers`` into ``stage``, in their order."""
        rings = stage.rings if stage.rings is not None else stage.allocate(self._mask + 1)
        bitmaps = stage.bitmaps
        base, bits, mask = stage.base, self._bits, self._mask
        level_of, powers = self._level_of, self._powers
        for timer_id, t in timers.items():
            level = level_of[(t ^ base).bit_length()]
            digit = t >> (level * bits) & mask
            slot = rings[level][digit]
            if not slot:
                bitmaps[level] |= powers[digit]
            slot[timer_id] = t

    def _place_popped(self, stage: Stage[K], mid: dict[K, int], n: int) -> None:
        """Pop ``n`` timers off ``mid``'s end into ``stage`` (:meth:`_stage_place` inlined)."""
        rings = stage.rings if stage.rings is not None else stage.allocate(self._mask + 1)
        bitmaps = stage.bitmaps
        base, bits, mask = stage.base, self._bits, self._mask
        level_of, powers, pop = self._level_of, self._powers, mid.popitem
        for _ in range(n):
            timer_id, t = pop()
            level = level_of[(t ^ base).bit_length()]
            digit = t >> (level * bits) & mask
            slot = rings[level][digit]
            if not slot:
                bitmaps[level] |= powers[digit]
            slot[timer_id] = t

    def _stage_work(self, stage: Stage[K]) -> int:
        """Steps left to pre-split ``stage``: two per timer of the source or ``late``."""
        if stage.digit < 0:
            return 0
        source = self._slots[stage.level][stage.digit]
        return 2 * (len(source) + len(stage.late)) + len(stage.mid)

    def _presplit(self, stage: Stage[K], quota: int) -> int:
        """Move up to ``quota`` steps (all if negative) of ``stage``'s source; return done.

        Source to ``mid`` by ``popitem`` (last first), then ``mid`` to the rings by
        ``popitem``, which restores insertion order; ``late`` becomes the next source.
        """
        level, digit = stage.level, stage.digit
        done = 0
        while quota < 0 or done < quota:
            source = self._slots[level][digit]
            mid = stage.mid
            if source and not mid and (quota < 0 or len(source) <= quota - done):
                # all of it fits: one pass in insertion order, no reversal needed
                n = len(source)
                self._place_all_staged(stage, source)
                self._cascaded += n
                done += n
                source.clear()
                self._bitmaps[level] ^= self._powers[digit]
                self._slot_visits += 1
            elif source:
                n = len(source) if quota < 0 else min(quota - done, len(source))
                pop = source.popitem
                for _ in range(n):
                    timer_id, t = pop()
                    mid[timer_id] = t
                done += n
                if not source:
                    source.clear()  # give the emptied table back
                    self._bitmaps[level] ^= self._powers[digit]
                    self._slot_visits += 1
            elif mid:
                n = len(mid) if quota < 0 else min(quota - done, len(mid))
                self._place_popped(stage, mid, n)
                self._cascaded += n
                done += n
                if not mid:
                    mid.clear()
            elif stage.late:
                self._slots[level][digit], stage.late = stage.late, source
                self._bitmaps[level] |= self._powers[digit]
            else:
                break
        return done

    def _presplit_paced(self) -> None:
        """Move the chunks that are due, at most the budget in all, and plan the next ones.

        A stage's chunk is ``MIN_CHUNK`` steps, or more if the calls came seldom: the share
        of its remaining work that the time since its last chunk is of the time that was
        left then. Chunks are planned evenly over the time left before the slot, so the
        work ends before it, where entering costs no move. Shards crossing one boundary
        have different amounts to move, so their chunks fall in different turns.
        """
        budget = self._budget
        chunk = min(MIN_CHUNK, budget)
        now = self._now
        for stage in self._stages[FIRST_STAGED:]:
            if stage.digit < 0 or now < stage.due:
                continue
            work = self._stage_work(stage)
            if work:
                left = stage.base - stage.paced_at
                share = max(chunk, -(-work * (now - stage.paced_at) // left))
                budget -= self._presplit(stage, min(share, budget))
            stage.paced_at = now
            if budget <= 0:
                break
        self._schedule_chunks()

    def _schedule_chunks(self) -> None:
        """Plan each stage's next chunk: ``MIN_CHUNK`` steps of its work, evenly paced."""
        chunk = min(MIN_CHUNK, self._budget)
        soonest = NEVER
        slots = self._slots
        for stage in self._stages[FIRST_STAGED:]:
            if stage.digit < 0:
                continue
            work = 2 * (len(slots[stage.level][stage.digit]) + len(stage.late)) + len(stage.mid)
            if work:
                # every (chunk / work) of the time left; less work than a chunk: at (work /
                # chunk) of it, so that shards with different amounts move in different turns
                left = stage.base - stage.paced_at
                spacing = left * min(work, chunk) // max(work, chunk)
                stage.due = stage.paced_at + max(1, min(spacing, left - 1))
                if stage.due < soonest:
                    soonest = stage.due
        self._chunk_at = soonest

    def _presplit_wakeup(self) -> int | None:
        """The tick by which the next advance should come so pre-splits keep pace, or None.

        Only when a stage has more work left than one budget: less is done on entering.
        """
        if self._chunk_at == NEVER:
            return None
        now = self._now
        soonest = None
        for stage in self._stages[FIRST_STAGED:]:
            work = self._stage_work(stage)
            if work > self._budget:
                at = now + max(1, (stage.base - now) * self._budget // (2 * work))
                soonest = at if soonest is None else min(soonest, at)
        return soonest
