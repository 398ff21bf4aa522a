"""Wait for work: PostgreSQL LISTEN on its own connection, or a plain sleep elsewhere.

The engine sleeps here between wheel deadlines; a notification from a scheduling
transaction ends the sleep early so a timer due in 50 ms is not held back by a 1 s nap.

The connection is opened from ``DURABLE["LISTEN_DATABASE"]`` (default: ``DATABASE``):
behind a pooler in transaction mode a LISTEN does not outlive its transaction, so the
listen alias must reach PostgreSQL directly. Any role may NOTIFY on the channel, so what
arrives is a hint, and what one wait can cost is bounded (:func:`sort_notices`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Container
from typing import Any

from django.db import connections

from durable.storage.notify import CHANNEL, Notice, parse

#: Most timer ids one wait puts into wheels; the shards of the rest are rescanned instead.
MAX_TIMERS_PER_WAIT = 5_000


def sort_notices(
    notices: list[Notice], owned: Container[int], cap: int = MAX_TIMERS_PER_WAIT
) -> tuple[set[int], set[int], list[Notice]]:
    """Split one wait's notices: shards asked to rescan, shards overflowed, timers to add.

    Only ``owned`` shards count; each shard appears once, however often it was named. A
    shard asked to rescan needs none of its timer notices (the rescan reads them). Past
    ``cap`` timer notices, the shards of the others are returned as overflowed: their ids
    are dropped, and the engine rescans those shards in its next turn instead. A forged
    flood (any role can NOTIFY) therefore costs at most one rescan per owned shard and
    ``cap`` wheel entries per wait, whatever it holds.
    """
    rescans = {n.shard for n in notices if n.timer_id is None and n.shard in owned}
    overflowed: set[int] = set()
    timers: list[Notice] = []
    for notice in notices:
        if notice.timer_id is None or notice.fire_at_ms is None:
            continue
        if notice.shard in rescans or notice.shard not in owned:
            continue
        if len(timers) >= cap:
            overflowed.add(notice.shard)
            continue
        timers.append(notice)
    return rescans, overflowed - rescans, timers


class Listener:
    """LISTENs on :data:`~durable.storage.notify.CHANNEL` when the database supports it."""

    def __init__(self, db: str, stop: threading.Event) -> None:
        self.db = db
        self.stop = stop
        self.enabled = connections[db].vendor == "postgresql"
        self._conn: Any = None

    def wait(self, timeout_s: float) -> list[Notice]:
        """Return notices that arrive within ``timeout_s`` (at once if some are queued)."""
        if not self.enabled:
            self.stop.wait(timeout_s)
            return []
        # This connection is ours, not Django's: translate psycopg's errors into Django's
        # so the engine's reconnect-with-backoff path handles a dropped LISTEN session.
        with connections[self.db].wrap_database_errors:
            try:
                return self._wait(timeout_s)
            except Exception:
                self.close()
                raise

    def _wait(self, timeout_s: float) -> list[Notice]:
        conn = self._connect()
        notices: list[Notice] = []
        for note in conn.notifies(timeout=max(timeout_s, 0.0), stop_after=1):
            notices.extend(parse(note.payload))
        if notices:  # drain whatever else is already queued, without waiting
            # All of it: parsing is cheap, and leaving notices queued under a steady load
            # made them later and later, until the rescan found their timers first.
            # What they may cost is bounded by sort_notices.
            for note in conn.notifies(timeout=0.0):
                notices.extend(parse(note.payload))
        return notices

    def close(self) -> None:
        """Drop the LISTEN connection (it is reopened on the next wait)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # a broken connection may refuse to close
                conn.close()

    def _connect(self) -> Any:
        if self._conn is None or self._conn.closed:
            wrapper = connections[self.db]
            conn = wrapper.get_new_connection(wrapper.get_connection_params())
            conn.autocommit = True
            conn.execute(f"LISTEN {CHANNEL}")
            self._conn = conn
        return self._conn
