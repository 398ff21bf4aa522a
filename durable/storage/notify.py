"""PostgreSQL NOTIFY: tell the owning worker about a new near-term timer at commit.

``pg_notify`` inside the scheduling transaction is delivered only if that transaction
commits, so a rolled-back schedule is never announced. Delivery is best effort: the
worker's periodic rescan finds any timer whose notification was lost (DESIGN §6).

Payloads on channel :data:`CHANNEL`, several separated by ``;``:

- ``"<shard>,<timer id>,<fire_at_ms>"``: one timer;
- ``"<shard>,*"``: rescan that shard's near-term window (bulk scheduling).

A worker firing a batch also collects the timers its handlers schedule
(:func:`collecting`), so a follow-up, a retry of a workflow step or a schedule's next
occurrence enters its wheel right after the batch commits: no NOTIFY round trip, and
no wait for the rescan on SQLite, which has no NOTIFY.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from django.db import connections

CHANNEL = "durable_timers"
MAX_PAYLOAD = 7900  # PostgreSQL's limit is 8000 bytes


@dataclass(frozen=True, slots=True)
class Notice:
    """One parsed notification: a timer (``timer_id`` set) or a whole-shard rescan."""

    shard: int
    timer_id: int | None = None
    fire_at_ms: int | None = None


#: (shard, timer id, fire_at_ms) of the timers announced while :func:`collecting` is active.
Announced = list[tuple[int, int, int]]


class _Collector:
    """What a :func:`collecting` block announced, and the NOTIFY payloads it holds back."""

    def __init__(self) -> None:
        self.announced: Announced = []
        self.held: dict[str, list[str]] = {}  # database alias -> payload parts


_collector: ContextVar[_Collector | None] = ContextVar("durable_announced", default=None)


@contextmanager
def collecting() -> Iterator[Announced]:
    """Collect the timers announced in this block (the firer, around one batch).

    Notifications are held and sent together when the block ends without an exception,
    one ``pg_notify`` instead of one per timer; the block must end inside the
    transaction that wrote the timers, so that they are still delivered at its commit.
    The list may name timers whose savepoint rolled back afterwards: whoever uses it
    must treat an id as a hint (the wheel does: the row is the truth).
    """
    collector = _Collector()
    token = _collector.set(collector)
    try:
        yield collector.announced
    finally:
        _collector.reset(token)
    for using, parts in collector.held.items():
        _send(using, parts)


def collecting_now() -> bool:
    """True inside a :func:`collecting` block (a firing batch's handlers)."""
    return _collector.get() is not None


def supports_notify(using: str) -> bool:
    """Return True when the database can LISTEN/NOTIFY (PostgreSQL)."""
    return connections[using].vendor == "postgresql"


def notify_timers(using: str, timers: Iterable[tuple[int, int, int]]) -> None:
    """Announce ``(shard, id, fire_at_ms)`` timers in the current transaction."""
    timers = list(timers)
    parts = [f"{shard},{tid},{fire_at}" for shard, tid, fire_at in timers]
    collector = _collector.get()
    if collector is None:
        _send(using, parts)
        return
    collector.announced.extend(timers)
    if parts and supports_notify(using):
        collector.held.setdefault(using, []).extend(parts)


def notify_shards(using: str, shards: Iterable[int]) -> None:
    """Ask the owners of ``shards`` to rescan their near-term window."""
    _send(using, [f"{shard},*" for shard in sorted(set(shards))])


def _send(using: str, parts: list[str]) -> None:
    if not parts or not supports_notify(using):
        return
    payloads: list[str] = []
    current = ""
    for part in parts:
        if current and len(current) + len(part) + 1 > MAX_PAYLOAD:
            payloads.append(current)
            current = ""
        current = f"{current};{part}" if current else part
    payloads.append(current)
    with connections[using].cursor() as cursor:
        for payload in payloads:
            cursor.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])


def parse(payload: str) -> list[Notice]:
    """Parse a payload into notices; malformed parts are ignored (rescan covers them)."""
    notices: list[Notice] = []
    for part in payload.split(";"):
        fields = part.split(",")
        try:
            if len(fields) == 2 and fields[1] == "*":
                notices.append(Notice(int(fields[0])))
            elif len(fields) == 3:
                notices.append(Notice(int(fields[0]), int(fields[1]), int(fields[2])))
        except ValueError:
            continue
    return notices
