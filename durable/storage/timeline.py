"""Refuse an old primary that came back: the worker never fires on a stale timeline.

After a failover the promoted replica writes on a new *timeline* (PostgreSQL numbers
them: 1, 2, ...), and the old primary, if it restarts with its data and accepts writes,
is still on the old one. A worker with a multi-host URL (``target_session_attrs=
read-write``) connects to the first host that accepts writes, which can be that old
primary: its rows stop at the moment it died, so the worker would fire there, a second
time, timers the new primary has already fired (the lease fence cannot help: each server
has its own lease rows).

Every server made from the same ``initdb`` (a primary and its replicas) shares one
``system_identifier``. This process remembers the highest timeline it has seen for each
system identifier; a new connection to a server of the same system on a *lower*
timeline is closed at once and :class:`StalePrimaryError` raised, which the engine treats
as the database being unavailable (it logs ``database.stale_primary``, backs off and
connects again, and libpq tries the hosts again). Nothing fires until a current primary
is reached. The memory is per process: a worker started after the old primary came back,
that never saw the new timeline, cannot tell (see the deploying guide: fence the old
primary).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.db import OperationalError

log = logging.getLogger("durable.worker")

# The current WAL file's name starts with the timeline, 8 hex digits. pg_control_checkpoint()
# would lag: its timeline changes only at the first checkpoint after a promotion.
_SQL = (
    "SELECT system_identifier::text, pg_is_in_recovery(), "
    "CASE WHEN pg_is_in_recovery() THEN NULL "
    "ELSE pg_walfile_name(pg_current_wal_lsn()) END "
    "FROM pg_control_system()"
)

_highest: dict[str, int] = {}
_lock = threading.Lock()
_warned = False


class StalePrimaryError(OperationalError):
    """The server is on an older timeline than one this process has already used."""


def read_position(connection: Any) -> tuple[str, int] | None:
    """``(system identifier, timeline)`` of the server ``connection`` is on, or None for a
    standby (it refuses writes anyway) or a database that is not PostgreSQL."""
    if connection.vendor != "postgresql":
        return None
    try:
        with connection.connection.cursor() as cursor:  # the raw driver: no Django wrappers
            cursor.execute(_SQL)
            system, in_recovery, walfile = cursor.fetchone()
    except Exception as exc:  # a managed server may refuse these functions: no guard then
        global _warned
        if not _warned:
            _warned = True
            log.warning(
                "database.timeline_unknown error=%s: the worker cannot tell an old primary "
                "that came back from the current one on this server",
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
        return None
    if in_recovery or not walfile:
        return None
    return str(system), int(walfile[:8], 16)


def check(connection: Any) -> None:
    """Remember the timeline of a new connection's server, or refuse it if stale.

    Called for each new connection of the worker to ``DATABASE``. On a stale server the
    connection is closed (Django would otherwise reuse it without asking again) and
    :class:`StalePrimaryError` raised.
    """
    position = read_position(connection)
    if position is None:
        return
    system, timeline = position
    with _lock:
        highest = _highest.get(system, 0)
        if timeline >= highest:
            _highest[system] = timeline
            return
    settings = connection.settings_dict
    where = f"{settings.get('HOST') or 'local'}:{settings.get('PORT') or ''}"
    connection.close()
    raise StalePrimaryError(
        f"database.stale_primary: the server reached through {where} is on timeline "
        f"{timeline} of system {system}, older than timeline {highest} this worker has "
        "already used: an old primary that came back after a failover; refusing it"
    )


def forget() -> None:
    """Forget every timeline seen (tests that rebuild clusters in one process)."""
    with _lock:
        _highest.clear()
