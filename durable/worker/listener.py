"""Wait for work: PostgreSQL LISTEN on its own connection, or a plain sleep elsewhere.

The engine sleeps here between wheel deadlines; a notification from a scheduling
transaction ends the sleep early so a timer due in 50 ms is not held back by a 1 s nap.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from django.db import connections

from durable.storage.notify import CHANNEL, Notice, parse


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
