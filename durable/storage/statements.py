"""Cursors for the statements the worker runs thousands of times: preparable on PostgreSQL.

Django's psycopg 3 backend binds parameters on the client (``ClientCursor``): every
statement reaches the server as new text, and the server parses and plans it again. For
the hot statements of the worker (a step's checkpoint, a run's end, the firer's batch
queries) that was about half of their cost: a step's checkpoint took 0.47 ms a call
unprepared and 0.26 ms prepared, in a loop of 500 on the development machine.

:func:`cursor` gives those statements a cursor that binds on the server, which psycopg
prepares once a statement has run ``prepare_threshold`` times on the connection. Whether
it prepares stays the project's choice: Django turns preparing off by default
(``prepare_threshold=None``, because a connection pooler in transaction mode may not
carry prepared statements across transactions), and ``"OPTIONS": {"prepare_threshold":
5}`` in the database settings (``?prepare_threshold=5`` in a ``DATABASE_URL``) turns it on
for the worker's connections. Without it these cursors bind on the server and prepare
nothing, at the cost of Django's own cursors. Django's cursor wrapper is kept, so the
statements still show in ``connection.queries`` and in ``CaptureQueriesContext``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
