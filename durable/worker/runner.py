"""One owned shard in memory: its near-term timers in a timing wheel.

The runner holds only buckets up to ``now_bucket + HORIZON_BUCKETS``; later rows stay in
the database, which acts as the wheel's coarsest level, and are loaded bucket by bucket as
time approaches. Memory therefore follows near-term volume, not total pending timers.

Three feeds put ids into the wheel, and the wheel dedupes them (an id already pending is
skipped): the bucket loader, NOTIFY from scheduling transactions, and a periodic rescan
of everything due soon. The rescan is what makes a lost notification a delay, not a loss.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Iterable

from durable.conf import DurableSettings
from durable.core.sharding import bucket_of, bucket_start_ms
from durable.core.wheel import TimingWheel
from durable.storage import claims, firing
from durable.worker.leasing import Acquired
from durable.worker.logs import event

log = logging.getLogger("durable.worker")

WARM_BUCKETS_PER_TURN = 8
"""A warm takeover's horizon is read this many buckets a turn, one shard a turn (see
:func:`load_acquired`): turns stay short, so the loop keeps handing due work to the
handlers' threads (a whole third of the shards' horizons at once kept the woken
workflow runs waiting for threads for a second and more)."""

REPLICATE_AHEAD_MS = 60_000
"""Raft on: a timer is replicated when it comes within this of its fire time, not when it
enters the wheel (the wheel holds ~70 min). The standby exists for the takeover's first
second (its overdue timers fire before the rows are read); a minute covers that many
times over, and keeps the replicated state (and so pysyncobj's full-state transfer to a
follower that fell behind) to a minute of timers instead of the whole horizon: a
million timers in the horizon broke that transfer."""

LATER_SHIFT = 13
"""Timers further out wait in slots of 2**13 ms (8.2 s) of fire time, as two compact
arrays (16 bytes a timer), until the slot comes within :data:`REPLICATE_AHEAD_MS`."""


class ShardRunner:
    """The in-memory state of one shard this worker holds the lease of."""

    def __init__(self, *, shard: int, token: int, db: str, conf: DurableSettings, now_ms: int):
        self.shard = shard
        self.token = token
        self.db = db
        self.conf = conf
        self.wheel: TimingWheel[int] = TimingWheel(start_ms=now_ms)
        self.loaded_upto_bucket = -1  # every pending row in buckets <= this is in the wheel
        self.cursor_ms = 0
        self.next_rescan_ms = 0
        self.rebuild_s = 0.0  # how long loading the shard took (metrics)
        # Raft on: what entered (id -> fire_at) and left (id -> None) the wheel since the
        # last replicated batch; the last change of an id wins. None: Raft off.
        self.journal: dict[int, int | None] | None = None
        # Raft on: timers not yet within REPLICATE_AHEAD_MS, by slot (fire_at >> LATER_SHIFT);
        # slots before later_from are journalled directly.
        self.later: dict[int, tuple[array[int], array[int]]] = {}
        self.later_from = 0
        # A warm takeover's (Raft): the horizon beyond the next bucket is read a few
        # buckets a turn (WARM_BUCKETS_PER_TURN), not all at once.
        self.paced = False

    def __repr__(self) -> str:
        return f"ShardRunner(shard={self.shard}, token={self.token}, pending={len(self.wheel)})"

    def add(self, timer_id: int, fire_at_ms: int) -> bool:
        """Put a timer in the wheel unless it is there already or beyond the loaded range."""
        if timer_id in self.wheel:
            return False
        if bucket_of(fire_at_ms, self.conf.BUCKET_SHIFT) > self.loaded_upto_bucket:
            return False  # the loader will read it when its bucket enters the horizon
        self.wheel.insert(timer_id, fire_at_ms)
        if self.journal is not None:
            self._note(timer_id, fire_at_ms)
        return True

    def start_journal(self, now_ms: int) -> None:
        """Raft on: from now, note what enters and leaves the wheel for replication."""
        self.journal = {}
        self.later = {}
        self.later_from = ((now_ms + REPLICATE_AHEAD_MS) >> LATER_SHIFT) + 1

    def _note(self, timer_id: int, fire_at_ms: int) -> None:
        slot = fire_at_ms >> LATER_SHIFT
        if slot < self.later_from:
            assert self.journal is not None
            self.journal[timer_id] = fire_at_ms
            return
        pair = self.later.get(slot)
        if pair is None:
            pair = self.later[slot] = (array("q"), array("q"))
        pair[0].append(timer_id)
        pair[1].append(fire_at_ms)

    def add_many(self, rows: Iterable[tuple[int, int]]) -> int:
        """Add ``(id, fire_at_ms)`` rows; return how many were new.

        :meth:`add` inlined: a rebuild feeds a million rows through here, and a rescan
        re-reads every row due soon (most already in the wheel) every few seconds.
        """
        wheel = self.wheel
        insert = wheel.insert
        # bucket_of(fire_at) <= loaded_upto_bucket  <=>  fire_at < first ms of the next bucket
        limit = bucket_start_ms(self.loaded_upto_bucket + 1, self.conf.BUCKET_SHIFT)
        added = 0
        journal = self.journal
        if journal is not None:  # Raft on: the same loop, also noting what it adds
            direct = self.later_from << LATER_SHIFT  # fire_at below: replicated now
            for timer_id, fire_at in rows:
                if fire_at < limit and timer_id not in wheel:
                    insert(timer_id, fire_at)
                    if fire_at < direct:
                        journal[timer_id] = fire_at
                    else:
                        self._note(timer_id, fire_at)
                    added += 1
            return added
        for timer_id, fire_at in rows:
            if fire_at < limit and timer_id not in wheel:
                insert(timer_id, fire_at)
                added += 1
        return added

    def rebuild(
        self, now_ms: int, upto_bucket: int | None = None, standby: dict[int, int] | None = None
    ) -> int:
        """Fill the wheel from the database after taking the lease: backlog and horizon
        (or up to ``upto_bucket``). ``standby``: what a warm takeover put in the wheel
        already (id to fire time); the rows' times win over it."""
        self.loaded_upto_bucket = upto_bucket or self._horizon_bucket(now_ms)
        overdue_and_soon = firing.rescan_due_soon(
            self.db, self.shard, now_ms, self.conf.BUCKET_SHIFT
        )
        ahead = firing.load_window(
            self.db,
            self.shard,
            bucket_of(now_ms, self.conf.BUCKET_SHIFT) - 1,
            self.loaded_upto_bucket,
        )
        if standby:
            for timer_id, fire_at in overdue_and_soon + ahead:
                # Moved since it was replicated (a reschedule the kill cut off): the wheel
                # has it at the standby's time, and a later one would make it fire late.
                if standby.get(timer_id, fire_at) != fire_at:
                    self.wheel.cancel(timer_id)
        loaded = self.add_many(overdue_and_soon) + self.add_many(ahead)
        self.next_rescan_ms = self._next_rescan_ms(now_ms)
        return loaded

    def load_ahead(self, now_ms: int) -> int:
        """Read the buckets that entered the horizon since the last call."""
        horizon = self._horizon_bucket(now_ms)
        if horizon <= self.loaded_upto_bucket:
            return 0
        if self.paced:
            horizon = min(horizon, self.loaded_upto_bucket + WARM_BUCKETS_PER_TURN)
            self.paced = horizon < self._horizon_bucket(now_ms)
        rows = firing.load_window(self.db, self.shard, self.loaded_upto_bucket, horizon)
        self.loaded_upto_bucket = horizon
        return self.add_many(rows)

    def rescan(self, now_ms: int) -> int:
        """Re-read what is due within two rescan intervals; return how many ids were new."""
        interval_ms = int(self.conf.RESCAN_INTERVAL_S * 1000)
        self.next_rescan_ms = self._next_rescan_ms(now_ms)
        rows = firing.rescan_due_soon(
            self.db, self.shard, now_ms + 2 * interval_ms, self.conf.BUCKET_SHIFT
        )
        return self.add_many(rows)

    def due(self, now_ms: int) -> list[int]:
        """Advance the wheel to ``now_ms`` and return the due ids, oldest first."""
        due = self.wheel.advance(now_ms)
        if self.journal is not None:
            # Out of the horizon: fired now, or re-added (a retry) through add().
            self.journal.update(dict.fromkeys(due))
        return due

    def put_back(self, ids: Iterable[int], now_ms: int) -> None:
        """Return ids that :meth:`due` gave out and this turn did not fire (its budget
        was spent): due at ``now_ms``, they come out first in the next turn. Their row
        is re-read when they fire, so the time put here only orders them (or delays
        them: a row found locked by another session is put back a little later,
        :data:`durable.worker.counting.LOCKED_RETRY_MS`)."""
        journal = self.journal
        for timer_id in ids:
            if timer_id not in self.wheel:
                self.wheel.insert(timer_id, now_ms)
                if journal is not None:
                    journal[timer_id] = now_ms  # still pending: not out of the horizon

    def take_journal(self, now_ms: int) -> dict[int, int | None]:
        """What changed since the last call (id -> fire time entered, None left), with the
        timers that came within :data:`REPLICATE_AHEAD_MS` meanwhile; the dict is the
        caller's now (handed to the Raft sidecar as it is)."""
        journal = self.journal if self.journal is not None else {}
        upto = (now_ms + REPLICATE_AHEAD_MS) >> LATER_SHIFT
        if upto >= self.later_from:
            slots = range(self.later_from, upto + 1)
            if len(slots) > len(self.later):  # a long gap (a clock jump): walk what there is
                slots = sorted(s for s in self.later if s <= upto)  # type: ignore[assignment]
            wheel = self.wheel
            for slot in slots:
                pair = self.later.pop(slot, None)
                if pair is not None:
                    for timer_id, fire_at in zip(*pair, strict=True):
                        # Fired, cancelled or moved meanwhile: no longer in the wheel.
                        if timer_id in wheel and timer_id not in journal:
                            journal[timer_id] = fire_at
            self.later_from = upto + 1
        self.journal = {}
        return journal

    def next_wakeup_ms(self) -> int | None:
        """When the wheel next has work (a fire or a cascade), or None when empty."""
        return self.wheel.next_expiry()

    def _next_rescan_ms(self, now_ms: int) -> int:
        """The next rescan: within one interval, at this shard's own phase of the interval.

        Shards taken in one turn (or all reset after a database error) would otherwise
        rescan in one turn forever after: 64 queries back to back, a stall that showed as
        the p99 of lateness. Phases spread evenly over the interval keep each turn's work
        small, and a rescan still comes at most one interval after the previous one.
        """
        interval = max(1, int(self.conf.RESCAN_INTERVAL_S * 1000))
        phase = self.shard * interval // max(1, self.conf.SHARDS)
        return ((now_ms - phase) // interval + 1) * interval + phase

    def _horizon_bucket(self, now_ms: int) -> int:
        """The last bucket to hold in memory: ``HORIZON_BUCKETS`` ahead, at this shard's phase.

        Each shard moves its horizon at its own phase of the bucket (as rescans are
        spread over their interval): otherwise every shard loads its next bucket in the
        same loop turn once per bucket (65.5 s), a stall of one query per shard that
        showed as the maximum of lateness. The horizon is late by less than one bucket.
        """
        size = 1 << self.conf.BUCKET_SHIFT
        phase = self.shard * size // max(1, self.conf.SHARDS)
        return bucket_of(now_ms - phase, self.conf.BUCKET_SHIFT) + self.conf.HORIZON_BUCKETS


def load_acquired(
    db: str, conf: DurableSettings, got: Acquired, now_ms: int, *, raft: bool = False
) -> ShardRunner:
    """Build the runner of a shard just acquired: the previous owner's claims are released
    to run again now (not at their claim timeout), then the wheel is rebuilt from the rows.
    Logs ``shard.loaded``; ``runner.rebuild_s`` says how long it took.

    ``raft``: the runner journals its wheel for replication; and when the standby
    held timers (``got.standby``, those due within about a minute), it is a warm
    takeover: they go in at their own times, the rows are read up to the next bucket
    only (the rows' times win over the standby's), and the rest of the horizon a few
    buckets a turn (``paced``): a third of the shards with 1M timers pending was about a
    second of reads in one turn, with the handlers' threads waiting for the interpreter
    behind it. Each fire is fenced and re-reads its row (due, pending), so a stale
    standby entry is a no-op.
    """
    started = time.monotonic()
    runner = ShardRunner(shard=got.shard, token=got.token, db=db, conf=conf, now_ms=now_ms)
    runner.cursor_ms = got.cursor_ms
    if raft:
        runner.start_journal(now_ms)
    rerun = claims.release_stale_claims(db, got.shard, got.token, now_ms)
    if got.standby:
        standby = dict(got.standby)
        for timer_id, fire_at in standby.items():  # at their own times: none fires early
            runner.wheel.insert(timer_id, fire_at)
        # Up to the next bucket, and at least the standby's furthest timer (a minute and a
        # slot of LATER_SHIFT ahead at most): each one's row is read, and its time wins.
        near = bucket_of(max(now_ms + 1, *standby.values()), conf.BUCKET_SHIFT)
        near = max(near, bucket_of(now_ms, conf.BUCKET_SHIFT) + 1)
        loaded = len(standby) + runner.rebuild(now_ms, upto_bucket=near, standby=standby)
        runner.paced = True
    else:
        loaded = runner.rebuild(now_ms)
    runner.rebuild_s = time.monotonic() - started
    event(
        log,
        logging.INFO,
        "shard.loaded",
        shard=got.shard,
        token=got.token,
        timers=loaded,
        reclaimed=rerun,
        rebuild_ms=int(runner.rebuild_s * 1000),
        lag_ms=max(0, now_ms - got.cursor_ms) if got.cursor_ms else 0,
    )
    return runner
