"""Calendars of cron and interval schedules, in epoch milliseconds: pure, no Django.

A *recurrence* yields occurrence instants (integer UTC epoch ms) after or before a given
instant. :class:`IntervalRecurrence` is arithmetic: a fixed UTC duration from an anchor,
so its cadence never changes across daylight-saving transitions. :class:`CronRecurrence`
evaluates a cron expression on the *wall clock* of an IANA time zone with croniter
(over naive local times, so croniter never sees an offset) and maps each wall time to
instants with zoneinfo. Two rules follow Vixie cron and cronie, so that a line copied
from a server's crontab fires on the same days and at the same instants:

- Day of month and day of week: when either field starts with ``*`` (``*``, ``*/2``)
  a day must match both; when both are restricted (``1,15`` and ``mon``) a day that
  matches either one fires. ``0 12 */2 * 1`` is odd-numbered days that are Mondays;
  ``0 12 1 * 1`` is the 1st of the month and every Monday.
- Daylight saving, for *fixed-time* expressions (neither the minute nor the hour field
  starts with ``*``): a wall time skipped by a spring-forward transition (02:30 on the
  day clocks jump from 02:00 to 03:00) fires once, at the first valid instant after the
  gap (03:00 local); a wall time that occurs twice at a fall-back transition fires
  once, at its first occurrence (the summer-time one).
- *Wildcard* expressions (the minute or the hour field starts with ``*``: ``*/15 * * *
  *``, ``0 */2 * * *``, ``@hourly``) follow the clock as it runs: a skipped wall time
  does not fire and a repeated one fires at both instants; an hourly job runs 23 times
  on the short day and 25 times on the long one.

The catch-up and overlap policies that use these calendars are in
:mod:`durable.core.catchup`.
"""

from __future__ import annotations

import heapq
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter  # type: ignore[import-untyped]  # no stubs shipped

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MIN_INTERVAL_MS = 1_000
# Real zones never move their offset back by more than this at once; it bounds how far
# before a given wall time an occurrence after the matching instant can hide.
_MAX_SHIFT = timedelta(hours=3)
_MS = timedelta(milliseconds=1)
MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_AT = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)$")


def zone(name: str) -> ZoneInfo:
    """Return the IANA time zone ``name``; ``ValueError`` if there is no such zone."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"time zone must be a non-empty IANA name, got {name!r}")
    try:
        return _zone(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {name!r} (expected an IANA name such as 'Europe/Paris')"
        ) from None


@lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def ms_to_wall(ms: int, tz: ZoneInfo) -> datetime:
    """Return the naive local wall time of instant ``ms`` in ``tz``."""
    return (EPOCH + ms * _MS).astimezone(tz).replace(tzinfo=None, fold=0)


def to_ms(aware: datetime) -> int:
    """Return an aware datetime as epoch ms (exact for whole milliseconds)."""
    return (aware - EPOCH) // _MS


class Recurrence(ABC):
    """Occurrence instants of a schedule, as integer UTC epoch milliseconds."""

    @abstractmethod
    def iter_after(self, ms: int) -> Iterator[int]:
        """Yield the occurrences strictly after ``ms``, in increasing order."""

    @abstractmethod
    def iter_before(self, ms: int) -> Iterator[int]:
        """Yield the occurrences at or before ``ms``, in decreasing order."""

    def next_after(self, ms: int) -> int:
        """Return the first occurrence strictly after ``ms``."""
        for found in self.iter_after(ms):
            return found
        raise ValueError(f"{self!r} has no occurrence after {ms}")

    def latest_at_or_before(self, ms: int) -> int | None:
        """Return the last occurrence at or before ``ms``, or None if there is none."""
        for found in self.iter_before(ms):
            return found
        return None

    def count(self, first: int, last: int, limit: int) -> int:
        """Count occurrences in ``[first, last]``, stopping at ``limit``."""
        if last < first:
            return 0
        n = 0
        for found in self.iter_after(first - 1):
            if found > last or n >= limit:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class IntervalRecurrence(Recurrence):
    """Every ``period_ms`` from ``anchor_ms`` (default: the Unix epoch), in UTC.

    Anchoring at a fixed instant rather than at "when the worker started" gives every
    process the same occurrences, so the occurrence keys agree across the cluster.
    """

    period_ms: int
    anchor_ms: int = 0

    def __post_init__(self) -> None:
        if self.period_ms < MIN_INTERVAL_MS:
            raise ValueError(f"interval must be at least 1 second, got {self.period_ms} ms")

    def iter_after(self, ms: int) -> Iterator[int]:
        """Yield ``anchor + k * period`` strictly after ``ms``, increasing."""
        at = self.anchor_ms + ((ms - self.anchor_ms) // self.period_ms + 1) * self.period_ms
        while True:
            yield at
            at += self.period_ms

    def iter_before(self, ms: int) -> Iterator[int]:
        """Yield ``anchor + k * period`` at or before ``ms``, decreasing."""
        at = self.anchor_ms + ((ms - self.anchor_ms) // self.period_ms) * self.period_ms
        while True:
            yield at
            at -= self.period_ms

    def count(self, first: int, last: int, limit: int) -> int:
        """Count occurrences in ``[first, last]`` by arithmetic (capped at ``limit``)."""
        if last < first:
            return 0
        low = -((self.anchor_ms - first) // self.period_ms)  # ceil((first - anchor) / p)
        high = (last - self.anchor_ms) // self.period_ms
        return max(0, min(limit, high - low + 1))


class CronRecurrence(Recurrence):
    """A cron expression on the wall clock of time zone ``tz`` (see the module docstring)."""

    def __init__(self, expression: str, tz: str = "UTC") -> None:
        self.expression = check_expression(expression)
        self.tz = tz
        self.tzinfo = zone(tz)
        self.day_or = day_or(self.expression)
        # Vixie cron's "wildcard" jobs (minute or hour field starting with "*") follow
        # the clock through DST transitions; fixed-time jobs fire once per wall time.
        minute, hour = self.expression.split()[:2]
        self.frequent = minute.startswith("*") or hour.startswith("*")

    def __repr__(self) -> str:
        return f"CronRecurrence({self.expression!r}, tz={self.tz!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CronRecurrence):
            return NotImplemented
        return (self.expression, self.tz) == (other.expression, other.tz)

    def __hash__(self) -> int:
        return hash((self.expression, self.tz))

    def instants(self, wall: datetime) -> tuple[int, ...]:
        """The instants naive wall time ``wall`` fires at (none, one, or two)."""
        first = to_ms(wall.replace(tzinfo=self.tzinfo, fold=0))
        if ms_to_wall(first, self.tzinfo) != wall:  # in a spring-forward gap
            return () if self.frequent else (self._gap_end(wall),)
        second = to_ms(wall.replace(tzinfo=self.tzinfo, fold=1))
        if second != first and self.frequent:  # repeated at fall-back: both, by elapsed time
            return (first, second)
        return (first,)

    def _bounds(self, wall: datetime) -> tuple[int, int]:
        # (lowest, highest) instant ``wall`` could map to; both never decrease as wall
        # time increases, which is what lets the iterators below stop early.
        first = to_ms(wall.replace(tzinfo=self.tzinfo, fold=0))
        if ms_to_wall(first, self.tzinfo) != wall:
            end = self._gap_end(wall)
            return end, end
        return first, to_ms(wall.replace(tzinfo=self.tzinfo, fold=1))

    def _gap_end(self, wall: datetime) -> int:
        # The transition instant: fold=0 reads ``wall`` with the offset before the gap
        # (an instant after the transition), fold=1 with the one after (an instant
        # before it). Bisect between the two for where the offset changes.
        low = to_ms(wall.replace(tzinfo=self.tzinfo, fold=1))
        high = to_ms(wall.replace(tzinfo=self.tzinfo, fold=0))
        before = self._offset(low)
        while high - low > 1_000:
            mid = (low + high) // 2
            if self._offset(mid) == before:
                low = mid
            else:
                high = mid
        # Transitions fall on whole seconds: the first one after ``low``.
        return (low // 1_000 + 1) * 1_000

    def _offset(self, ms: int) -> timedelta:
        return (EPOCH + ms * _MS).astimezone(self.tzinfo).utcoffset() or timedelta(0)

    def iter_after(self, ms: int) -> Iterator[int]:
        """Yield the occurrences strictly after ``ms``, increasing, each instant once."""
        # Wall times a little before wall(ms) can still fire after ms when a fall-back
        # lies ahead: start earlier by the size of that shift.
        shift = self._offset(ms) - self._offset(ms + _MAX_SHIFT // _MS)
        start = ms_to_wall(ms, self.tzinfo) - max(shift, timedelta(0)) - timedelta(seconds=1)
        it = croniter(self.expression, start, day_or=self.day_or)
        ready: list[int] = []
        last = ms
        while True:
            wall = _step(it, forward=True)
            if wall is None:
                break
            low, _ = self._bounds(wall)
            while ready and ready[0] < low:  # nothing later can come before these
                found = heapq.heappop(ready)
                if found > last:
                    last = found
                    yield found
            for instant in self.instants(wall):
                heapq.heappush(ready, instant)
        while ready:
            found = heapq.heappop(ready)
            if found > last:
                last = found
                yield found

    def iter_before(self, ms: int) -> Iterator[int]:
        """Yield the occurrences at or before ``ms``, decreasing, each instant once."""
        shift = self._offset(ms - _MAX_SHIFT // _MS) - self._offset(ms)
        start = ms_to_wall(ms, self.tzinfo) + max(shift, timedelta(0)) + timedelta(seconds=1)
        it = croniter(self.expression, start, day_or=self.day_or)
        ready: list[int] = []  # a max-heap, as negated values
        last = ms + 1
        while True:
            wall = _step(it, forward=False)
            if wall is None:
                break
            _, high = self._bounds(wall)
            while ready and -ready[0] > high:
                found = -heapq.heappop(ready)
                if found < last:
                    last = found
                    yield found
            for instant in self.instants(wall):
                heapq.heappush(ready, -instant)
        while ready:
            found = -heapq.heappop(ready)
            if found < last:
                last = found
                yield found


def _step(it: croniter, *, forward: bool) -> datetime | None:
    try:
        wall: datetime = it.get_next(datetime) if forward else it.get_prev(datetime)
    except Exception:  # croniter's CroniterBadDateError: the calendar has run out
        return None
    return wall.replace(fold=0)


def day_or(expression: str) -> bool:
    """Whether a day matching day-of-month *or* day-of-week fires (Vixie cron's rule).

    True only when both fields are restricted and neither starts with ``*`` (or ``?``);
    otherwise a day must match both, as in Vixie cron and cronie (croniter's default
    would OR ``*/2`` with ``mon``).
    """
    fields = expression.split()
    return not any(fields[i].startswith(("*", "?")) for i in (2, 4))


def check_expression(expression: str) -> str:
    """Return ``expression`` normalized (macros expanded); ``ValueError`` if it is invalid.

    Five fields (minute hour day-of-month month day-of-week), or six with seconds last
    (croniter's convention); ``@hourly``, ``@daily``, ``@weekly``, ``@monthly`` and
    ``@yearly`` are accepted. An expression that never fires (``0 0 30 2 *``) is refused,
    judged with the day rule of :func:`day_or`.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError(f"cron expression must be a non-empty string, got {expression!r}")
    text = " ".join(expression.split())
    text = MACROS.get(text.lower(), text)
    if text.startswith("@"):
        raise ValueError(f"invalid cron expression {expression!r}: unknown macro")
    if len(text.split()) not in (5, 6):
        raise ValueError(
            f"invalid cron expression {expression!r}: expected 5 fields "
            "(minute hour day month weekday), or 6 with seconds last"
        )
    try:
        croniter(text, datetime(2000, 1, 1), day_or=day_or(text)).get_next(datetime)
    except Exception as exc:  # croniter raises several unrelated types
        reason = str(exc).replace(f"[{text}] ", "") or type(exc).__name__
        if "failed to find next date" in reason:
            reason = "it never matches a date"
        raise ValueError(f"invalid cron expression {expression!r}: {reason}") from None
    return text


def parse_at(at: str | time) -> tuple[int, int]:
    """Return ``(hour, minute)`` of ``"HH:MM"`` or a ``datetime.time`` (seconds must be 0)."""
    if isinstance(at, time):
        if at.second or at.microsecond or at.tzinfo is not None:
            raise ValueError(f"at: {at!r} must be a whole minute without tzinfo; pass tz=")
        return at.hour, at.minute
    match = _AT.match(at) if isinstance(at, str) else None
    if match is None:
        raise ValueError(f"at: expected 'HH:MM' (24-hour), got {at!r}")
    return int(match.group(1)), int(match.group(2))


def hourly_expression(minute: int = 0) -> str:
    """Cron expression for every hour at ``minute``."""
    if isinstance(minute, bool) or not isinstance(minute, int) or not 0 <= minute <= 59:
        raise ValueError(f"minute: expected an int in 0-59, got {minute!r}")
    return f"{minute} * * * *"


def daily_expression(at: str | time = "00:00") -> str:
    """Cron expression for every day at ``at``."""
    hour, minute = parse_at(at)
    return f"{minute} {hour} * * *"


def weekly_expression(on: str = "mon", at: str | time = "00:00") -> str:
    """Cron expression for ``on`` (``"mon"``, ``"mon-fri"``, ``"sat,sun"``) at ``at``."""
    hour, minute = parse_at(at)
    days = on.lower().replace(" ", "") if isinstance(on, str) else ""
    if not days or not all(part in _DAYS for part in re.split(r"[-,]", days)):
        raise ValueError(f"on: expected day names like 'mon', 'mon-fri', 'sat,sun'; got {on!r}")
    return check_expression(f"{minute} {hour} * * {days}")


def monthly_expression(day: int | str = 1, at: str | time = "00:00") -> str:
    """Cron expression for day ``day`` (1-31, or ``"last"``) of every month at ``at``.

    Months without that day are skipped, as in cron: ``day=31`` fires seven times a year.
    """
    hour, minute = parse_at(at)
    if day == "last":
        return f"{minute} {hour} L * *"
    if isinstance(day, bool) or not isinstance(day, int) or not 1 <= day <= 31:
        raise ValueError(f"day: expected 1-31 or 'last', got {day!r}")
    return f"{minute} {hour} {day} * *"
