"""What firing one occurrence of a schedule does: run it, catch up, or skip (pure).

Occurrences of a schedule form a chain: each fire decides what runs and which occurrence
comes next. :func:`decide` is that decision, computed from the calendar, the fire time
and the schedule's last stretch of runs, with no database and no clock of its own, so
the policies are unit-tested by feeding it instants.

Vocabulary (also in ``docs/how-to/schedules.md``):

- **overlapped**: the occurrence came due while runs of the same schedule were executing
  (``busy_since < occurrence <= busy_until``). ``overlap`` decides: ``skip`` drops it,
  ``queue`` runs it once those runs are over; several that piled up collapse into one
  queued run, the latest (so a handler slower than its cadence cannot build an unbounded
  backlog).
- **missed**: the occurrence could not fire in time while nothing was running: when it
  fires, a later occurrence is already due, or it is more than ``grace`` late. ``catch_up``
  decides: ``skip`` drops every missed occurrence, ``fire_once`` runs the latest missed one
  once, ``fire_all`` runs them all, oldest first, at most :data:`FIRE_ALL_CAP` (the older
  ones are counted as skipped).
- **on time**: neither. It always runs, whatever the policies, right after any queued or
  catch-up run decided by the same fire.

A fire runs at most three occurrences (queued, catch-up, on time), one after the other.
A ``fire_all`` backlog is decided once, at the first late fire: the timers that follow
carry ``catch_up=True``, ``until_ms`` (the backlog's last occurrence) and ``then_ms`` (the
on-time occurrence to run after it) and run without being judged again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from durable.core.cron import Recurrence

CATCH_UP_POLICIES = ("skip", "fire_once", "fire_all")
OVERLAP_POLICIES = ("skip", "queue")
FIRE_ALL_CAP = 1_000
DEFAULT_GRACE_MS = 60_000
# Counting skipped occurrences walks the calendar; past this many (a per-minute cron down
# for ten weeks) the count recorded is this lower bound rather than a long walk in a
# firing transaction.
COUNT_LIMIT = 100_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A schedule's catch-up and overlap policies, and its grace for lateness."""

    catch_up: str = "fire_once"
    overlap: str = "skip"
    grace_ms: int = DEFAULT_GRACE_MS

    def __post_init__(self) -> None:
        if self.catch_up not in CATCH_UP_POLICIES:
            raise ValueError(
                f"catch_up: expected one of {', '.join(CATCH_UP_POLICIES)}; got {self.catch_up!r}"
            )
        if self.overlap not in OVERLAP_POLICIES:
            raise ValueError(
                f"overlap: expected one of {', '.join(OVERLAP_POLICIES)}; got {self.overlap!r}"
            )
        if isinstance(self.grace_ms, bool) or not isinstance(self.grace_ms, int):
            raise ValueError(f"grace: expected a duration, got {self.grace_ms!r}")
        if self.grace_ms < 0:
            raise ValueError(f"grace: must not be negative, got {self.grace_ms} ms")


@dataclass(frozen=True, slots=True)
class Run:
    """One occurrence to run now."""

    occurrence_ms: int
    catch_up: bool = False
    """It stands in for missed occurrences (the handler is told)."""
    missed: int = 0
    """How many missed occurrences it deals with."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What one fire does: ``runs`` in order, ``skipped`` dropped, then ``next_ms``."""

    runs: tuple[Run, ...] = ()
    skipped: int = 0
    """Occurrences given up by this decision (counted on the schedule)."""
    next_ms: int
    """The occurrence the next timer is for (it may already be due)."""
    next_catch_up: bool | None = None
    """``True`` when the next timer belongs to a decided ``fire_all`` backlog."""
    until_ms: int | None = None
    """The last occurrence of that backlog."""
    then_ms: int | None = None
    """The on-time occurrence to run right after the backlog."""
    backlog: bool = False
    """This fire continues a decided backlog (its runs extend the current busy stretch)."""
    reason: str
    """``on_time``, ``missed``, ``overlap``, ``queued`` or ``backlog``, for the logs."""


def decide(
    rec: Recurrence,
    policy: Policy,
    *,
    scheduled_ms: int,
    now_ms: int,
    until_ms: int | None = None,
    then_ms: int | None = None,
    busy_since_ms: int | None = None,
    busy_until_ms: int | None = None,
) -> Decision:
    """Decide what the fire of occurrence ``scheduled_ms`` at ``now_ms`` does.

    ``until_ms``/``then_ms`` are set when the timer belongs to a decided ``fire_all``
    backlog. ``busy_since_ms``/``busy_until_ms`` bound the schedule's last stretch of
    runs (from the start of the fire that began it to the end of its last run).
    """
    if until_ms is not None and scheduled_ms <= until_ms:
        return _backlog(rec, scheduled_ms, until_ms, then_ms)
    if (
        busy_since_ms is None
        or busy_until_ms is None
        or not busy_since_ms < scheduled_ms <= busy_until_ms
    ):
        return _classify(rec, policy, scheduled_ms, now_ms, ())
    last = rec.latest_at_or_before(min(busy_until_ms, now_ms))
    assert last is not None and last >= scheduled_ms
    overlapped = rec.count(scheduled_ms, last, COUNT_LIMIT)
    queued: tuple[Run, ...] = ()
    if policy.overlap == "queue":
        queued, overlapped = (Run(last),), overlapped - 1
    following = rec.next_after(last)
    if following > now_ms:
        return Decision(
            runs=queued,
            skipped=overlapped,
            next_ms=following,
            reason="queued" if queued else "overlap",
        )
    # Due after the runs ended, yet not fired then: judged like any other occurrence.
    decision = _classify(rec, policy, following, now_ms, queued)
    return replace(decision, skipped=decision.skipped + overlapped)


def _classify(
    rec: Recurrence, policy: Policy, first: int, now_ms: int, before: tuple[Run, ...]
) -> Decision:
    """Run ``first`` if on time, else apply the catch-up policy to the missed ones."""
    latest = rec.latest_at_or_before(now_ms)
    assert latest is not None and latest >= first, "an occurrence fired before it was due"
    on_time = now_ms - latest <= policy.grace_ms
    after_latest = rec.next_after(latest)
    if latest == first and on_time:
        return Decision(runs=(*before, Run(first)), next_ms=after_latest, reason="on_time")
    # Missed: every due occurrence before the latest, and the latest too if it is late.
    current = (Run(latest),) if on_time else ()
    last_missed = latest
    if on_time:
        previous = rec.latest_at_or_before(latest - 1)
        assert previous is not None
        last_missed = previous
    missed = rec.count(first, last_missed, COUNT_LIMIT)
    if policy.catch_up == "skip":
        return Decision(
            runs=(*before, *current), skipped=missed, next_ms=after_latest, reason="missed"
        )
    if policy.catch_up == "fire_once":
        return Decision(
            runs=(*before, Run(last_missed, True, missed), *current),
            skipped=missed - 1,
            next_ms=after_latest,
            reason="missed",
        )
    return _fire_all(rec, first, last_missed, missed, before, latest if on_time else None)


def _fire_all(
    rec: Recurrence,
    first: int,
    last_missed: int,
    missed: int,
    before: tuple[Run, ...],
    on_time: int | None,
) -> Decision:
    start, skipped = first, 0
    if missed > FIRE_ALL_CAP:
        # Keep the newest FIRE_ALL_CAP; the older ones are skipped (and logged by the caller).
        for kept, occurrence in enumerate(rec.iter_before(last_missed), start=1):
            if kept == FIRE_ALL_CAP:
                start = occurrence
                break
        skipped = rec.count(first, start - 1, COUNT_LIMIT)
    step = _backlog(rec, start, last_missed, on_time)
    runs = (*before, Run(start, True, missed), *step.runs[1:])
    return Decision(
        runs=runs,
        skipped=skipped,
        next_ms=step.next_ms,
        next_catch_up=step.next_catch_up,
        until_ms=step.until_ms,
        then_ms=step.then_ms,
        reason="missed",
    )


def _backlog(rec: Recurrence, occurrence: int, until_ms: int, then_ms: int | None) -> Decision:
    """One step of a decided backlog: run ``occurrence``; then the next, or ``then_ms``."""
    following = rec.next_after(occurrence)
    if following <= until_ms:
        return Decision(
            runs=(Run(occurrence, True, 1),),
            next_ms=following,
            next_catch_up=True,
            until_ms=until_ms,
            then_ms=then_ms,
            backlog=True,
            reason="backlog",
        )
    runs: tuple[Run, ...] = (Run(occurrence, True, 1),)
    if then_ms is not None:  # the occurrence that was on time when the backlog was decided
        runs, following = (*runs, Run(then_ms)), rec.next_after(then_ms)
    return Decision(runs=runs, next_ms=following, backlog=True, reason="backlog")
