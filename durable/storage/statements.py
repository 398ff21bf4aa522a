"""Cursors for the statements the worker runs thousands of times: preparable on PostgreSQL.

Django's psycopg 3 backend binds parameters on the client (``ClientCursor``): every
statement reaches the server as new text, and the server parses and plans it again. For
the hot statements of the worker (a step's checkpoint, a run's end, the firer's batch
queries) that was about half of their cost: a step's checkpoint took 0.47 ms a call
unprepared and 0.26 ms prepared, in a loop of 500 on the development machine.

:func:`cursor` gives those statements a cursor that binds on the server, which psycopg
prepares once a statement has run ``prepare_threshold`` times on the connection. Whether
it prepares: Django turns preparing off by default (``prepare_threshold=None``, because a
connection pooler in transaction mode may not carry prepared statements across
transactions), so the worker turns it on for its own connections to ``DATABASE``
(:func:`prepare_on`) unless ``DURABLE["PREPARE_STATEMENTS"]`` says no or
``LISTEN_DATABASE`` says the database is pooled. A ``prepare_threshold`` in the
project's OPTIONS is kept as it is. Django's cursor wrapper is kept, so the
statements still show in ``connection.queries`` and in ``CaptureQueriesContext``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

try:  # psycopg 3 only: psycopg2 binds on the client
    from django.db.backends.postgresql.base import ServerBindingCursor
except (ImportError, ImproperlyConfigured):  # pragma: no cover - psycopg2, or no driver
    ServerBindingCursor = None


def cursor(db: str) -> Any:
    """A cursor on ``db`` whose statements the server may prepare (see the module doc).

    Use it as Django's: ``with cursor(db) as c: c.execute(sql, params)``. Parameters are
    bound by the server, so each needs a type the server can infer or an explicit cast
    (``%s::jsonb``). On other databases, Django's cursor.
    """
    conn = connections[db]
    if conn.vendor != "postgresql" or ServerBindingCursor is None:
        return conn.cursor()
    # What BaseDatabaseWrapper._cursor() does, with our cursor class instead of the
    # connection's factory (Django has no public way to ask for one cursor's binding).
    conn.close_if_health_check_failed()
    conn.ensure_connection()
    with conn.wrap_database_errors:
        return conn._prepare_cursor(ServerBindingCursor(conn.connection))


#: The ``prepare_threshold`` the worker gives its connections (see :func:`prepare_on`).
WORKER_PREPARE_THRESHOLD = 5


def should_prepare(conf: Any) -> bool:
    """Whether the worker prepares its hot statements (``DURABLE["PREPARE_STATEMENTS"]``)."""
    if conf.PREPARE_STATEMENTS is not None:
        return bool(conf.PREPARE_STATEMENTS)
    pooled = conf.LISTEN_DATABASE is not None and conf.LISTEN_DATABASE != conf.DATABASE
    return not pooled


def prepare_on(connection: Any) -> bool:
    """Let psycopg prepare this worker connection's server-bound statements; True if set.

    Django leaves ``prepare_threshold`` at None (nothing prepared) unless the project's
    OPTIONS say otherwise, which made every batch of the fire path parse and plan its
    statements again: at 2,000 fires/s on 2 cores the worker fell seconds behind (p99
    4.1 s, against 181 ms prepared; bench/pgbouncer.py --preload). Only the cursors of
    :func:`cursor` can be prepared: Django's own client-binding cursors never are, so the
    app's queries in handlers are untouched. A threshold the project set is kept.
    """
    raw = getattr(connection, "connection", None)
    if connection.vendor != "postgresql" or raw is None or ServerBindingCursor is None:
        return False
    if getattr(raw, "prepare_threshold", 0) is not None:
        return False  # the project chose a threshold (or this driver cannot prepare)
    raw.prepare_threshold = WORKER_PREPARE_THRESHOLD
    return True


#: The idle timeout of this transaction, set to itself: a no-op as written. Written in the
#: first statement of a transaction of the fire loop (in a condition evaluated before any
#: row is locked, since ``set_config`` returns non-NULL: ``AND {IDLE_GUARD} IS NOT NULL``),
#: it is where the worker's idle guard (:class:`durable.worker.housekeeping.IdleGuard`)
#: puts its timeout instead of sending a statement of its own: one round trip fewer per
#: transaction, which is what a fire costs behind a pooler (bench/firepath.py).
IDLE_GUARD = (
    "set_config('idle_in_transaction_session_timeout', "
    "current_setting('idle_in_transaction_session_timeout'), true)"
)


def idle_guard(timeout_ms: int) -> str:
    """What :data:`IDLE_GUARD` becomes in the worker's statements: its timeout, set for the
    transaction (``SET LOCAL``: never for the session, which a pooler shares)."""
    return f"set_config('idle_in_transaction_session_timeout', '{int(timeout_ms)}', true)"


def in_clause(
    vendor: str, ids: Sequence[int], column: str = "id", sql_type: str = "bigint"
) -> tuple[str, list[Any]]:
    """``column`` in ``ids`` as SQL: one array parameter on PostgreSQL, a list elsewhere.

    The array keeps the statement's text the same whatever the number of ids, so the
    server can prepare it once.
    """
    if vendor == "postgresql":
        return f"{column} = ANY(%s::{sql_type}[])", [int_array(ids)]
    return f"{column} IN ({', '.join(['%s'] * len(ids))})", list(ids)


def int_array(values: Iterable[int]) -> str:
    """A PostgreSQL array literal of integers.

    Built by join: psycopg's list dumper quotes element by element in Python, which
    showed up at ~10% of the fire path.
    """
    return "{" + ",".join(map(str, map(int, values))) + "}"


@functools.cache
def can_pipeline() -> bool:
    """Whether the PostgreSQL driver sends pipelines (psycopg 3 on libpq 14 or later)."""
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg2
        return False
    return bool(psycopg.Pipeline.is_supported())


@contextlib.contextmanager
def pipelined(db: str) -> Iterator[None]:
    """Send the statements of the block together: one round trip, not one each.

    On PostgreSQL (psycopg's pipeline mode): a statement's results are waited for only
    when read (a fetch), or at the end of the block, where an error of any of them is
    raised. Each still runs as a statement of its own, in order, with its own snapshot.
    For statements whose results nobody reads (``rowcount`` included); elsewhere, or
    with a driver that cannot pipeline, the block runs as it is.
    """
    conn = connections[db]
    if conn.vendor != "postgresql" or not can_pipeline():
        yield
        return
    conn.ensure_connection()
    with conn.wrap_database_errors, conn.connection.pipeline():
        yield
