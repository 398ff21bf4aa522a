"""PostgreSQL NOTIFY: tell the owning worker about a new near-term timer at commit.

``pg_notify`` inside the scheduling transaction is delivered only if that transaction
commits, so a rolled-back schedule is never announced. Delivery is best effort: the
worker's periodic rescan finds any timer whose notification was lost (DESIGN §6).

Payloads on channel :data:`CHANNEL`, several separated by ``;``:

- ``"<shard>,<timer id>,<fire_at_ms>"``: one timer;
- ``"<shard>,*"``: rescan that shard's near-term window (bulk scheduling).
"""

from __future__ import annotations

from collections.abc import Iterable
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


def supports_notify(using: str) -> bool:
    """Return True when the database can LISTEN/NOTIFY (PostgreSQL)."""
    return connections[using].vendor == "postgresql"


def notify_timers(using: str, timers: Iterable[tuple[int, int, int]]) -> None:
    """Announce ``(shard, id, fire_at_ms)`` timers in the current transaction."""
    _send(using, [f"{shard},{tid},{fire_at}" for shard, tid, fire_at in timers])


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
