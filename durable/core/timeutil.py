"""Conversions between the API's aware datetimes / timedeltas and internal epoch milliseconds.

Instants going *into* durable round **up** to the next millisecond: a timer asked for
12:00:00.0004 is stored at ...001, never ...000, so sub-millisecond precision can never
make it fire early (DESIGN §10, invariant 1). Arithmetic is exact integer timedelta
division, not ``timestamp() * 1000``, whose float rounding can go either way.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


def datetime_to_ms(when: datetime) -> int:
    """Return an aware ``datetime`` as UTC epoch milliseconds, rounded up.

    Raises ``ValueError`` for a naive datetime: its meaning depends on a time zone we
    would have to guess.
    """
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(f"naive datetime {when!r}: use an aware datetime")
    return ceil_ms(when - EPOCH)


def ceil_ms(delta: timedelta) -> int:
    """Return ``delta`` in whole milliseconds, rounded up (towards +infinity)."""
    return -(-delta // _MS)


def ms_to_datetime(ms: int) -> datetime:
    """Return epoch milliseconds as an aware UTC ``datetime`` (exact)."""
    return EPOCH + timedelta(milliseconds=ms)
