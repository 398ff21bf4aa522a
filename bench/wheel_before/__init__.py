"""The timing wheel as it was before issue 16 (main at 6e4453b), frozen for comparison.

``bench/wheel_boundary.py`` runs it beside ``durable.core.wheel`` in one process: this copy
splits a coarse slot all at once when time enters it. Not part of the package; not tested.

The original docstring follows.

Hierarchical timing wheel: O(1) insert and cancel, and idle time that costs nothing.

A shard runner keeps its near-term timers in a :class:`TimingWheel` and asks it, each time
it wakes, which ids are due (DESIGN §3). The wheel is pure: no clock, no threads, no I/O;
time moves only when the caller passes a later ``now_ms`` to ``advance``.

Layout. ``levels`` rings of ``slots`` slots (``slots = 2**bits``). A slot of level ``L``
spans ``slots**L`` ticks, so the default 5 x 256 at 1 ms covers 256 ms, 65.5 s, 4.66 h,
49.7 d and 34.8 y. Timers beyond the top level wait in an *overflow* map and come back into
the rings when time reaches their top-level block. A slot is a dict ``id -> tick``: cancel is
a ``del``, and draining a 1 ms slot is ``out += slot`` at C speed.

Placement invariant, which everything rests on. With ``now`` the current tick, a pending
timer due at tick ``t > now`` sits at level ``L = (bit_length(t ^ now) - 1) // bits``, slot
``(t >> L * bits) & mask``: the lowest ring that still tells ``t`` apart from ``now``. So:

* the slot is a function of ``(t, now)``: cancel recomputes it, no location is stored, and
  moving timers down updates nothing but slot maps;
* timers due in the same tick always share one slot map, and maps keep insertion order,
  which gives the order of ties for free;
* a level's occupied digits all exceed ``now``'s digit there, so "the next occupied slot"
  is the lowest set bit of the level's bitmap (an ``int``), found without looking at any
  empty slot;
* moving ``now`` to ``target`` only disturbs the slot holding ``target`` at the highest
  level whose digit changes: below it everything is due, above it everything stays put.
  The timers of that one slot that are not yet due move to a strictly lower level, exactly
  (never rounded to the coarse slot), so a timer moves down at most ``levels - 1`` times.
"""

from bench.wheel_before.timing_wheel import TimingWheel

__all__ = ["TimingWheel"]
