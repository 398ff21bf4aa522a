"""One-statement bulk insert of timers, fast enough for ``schedule_many`` at 100k rows.

Django's ``bulk_create`` adapts every value of every field in Python, about 80 us a row
for the 22 columns of ``Timer``: several times what PostgreSQL needs to insert the row.
On PostgreSQL this module sends one parameter per column instead, built at C speed, and
lets the database unnest them. Rows go through Django's connection, in the caller's
transaction, with the values ``bulk_create`` would have written.
"""

from __future__ import annotations

import gc
import json
import operator
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.db import connections, models

from durable.core.clock import current_datetime
from durable.models import Timer

_NUMBERS = (int, float)  # exact types: a bool or an IntEnum goes the JSON way

#: Timer's clock stamps (``durable.fields.ClockStampField``).
STAMPS = ("created_at", "updated_at")


def stamp_unset(timers: Iterable[Timer]) -> None:
    """Set the clock stamps a timer lacks to the injected clock's now, read once.

    What the field's ``pre_save`` does row by row, for a batch: its rows share one value
    (a single parameter of the columnar insert, which skips ``pre_save``), and a time the
    caller set is kept.
    """
    now: datetime | None = None
    for timer in timers:
        state = timer.__dict__
        for name in STAMPS:
            if state.get(name) is None:
                now = now or current_datetime()
                state[name] = now


def bulk_insert(db: str, timers: Sequence[Timer]) -> None:
    """Insert unsaved timers (no pk) with one statement; set their pks, in order.

    On PostgreSQL, a columnar ``INSERT ... SELECT``; elsewhere, or when a column cannot
    go that way, ``bulk_create`` (which SQLite splits by its bound-variable limit).
    """
    stamp_unset(timers)
    if len(timers) > 1 and connections[db].vendor == "postgresql":
        with paused_gc():
            sql, params = _columnar_insert(db, timers)
        if sql:
            with connections[db].cursor() as cursor:
                cursor.execute(sql, params)
                with paused_gc():
                    _mark_saved(db, timers, cursor.fetchall())
            return
    Timer.objects.using(db).bulk_create(timers)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector for a CPU-bound bulk step (never around I/O).

    Building 100k timers allocates millions of objects and no reference cycles; the
    collector, triggered by the allocation count, would re-scan all the new timers again
    and again: a third of the planning time and two thirds of the SQL building. Paused
    only while Python computes, so a statement waiting on a lock never holds it off.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _mark_saved(db: str, timers: Sequence[Timer], ids: list[tuple[int]]) -> None:
    # What bulk_create does after its INSERT, minus the per-row descriptor overhead.
    pk_name = Timer._meta.pk.attname
    for timer, (pk,) in zip(timers, ids, strict=True):
        timer.__dict__[pk_name] = pk
        state = timer._state
        state.adding = False
        state.db = db


def _columnar_insert(db: str, timers: Sequence[Timer]) -> tuple[str, list[Any]]:
    """Build ``INSERT ... SELECT`` over one array per column; ``""`` if a column is unfit.

    A column is one parameter: a numeric array literal, or a JSON array (one
    ``json.dumps``) for text and JSON columns; a column with the same value on every
    row (state, kind, often target, the timestamps) is a single value.
    """
    connection = connections[db]
    fields = [f for f in Timer._meta.concrete_fields if not f.primary_key]
    selects: list[str] = []  # one expression per column
    select_params: list[Any] = []
    # c0 counts the rows even when every column is uniform. A function scan reads its
    # result in order and INSERT ... RETURNING reports rows as inserted, so ids come back
    # in input order (the same guarantee Django's own UNNEST bulk insert relies on).
    sources = ["generate_series(1, %s)"]
    source_params: list[Any] = [len(timers)]
    # Transpose at C speed, one pass per timer (cache-friendly); the 22-tuples are why
    # the caller pauses the cyclic GC, which would otherwise re-scan every new timer.
    row = operator.itemgetter(*(field.attname for field in fields))
    columns = zip(*(row(timer.__dict__) for timer in timers), strict=True)
    for field, values in zip(fields, columns, strict=True):
        column = _column(field, list(values), connection, f"c{len(sources)}")
        if column is None:
            return "", []
        select, param, source = column
        selects.append(select)
        if source is None:
            select_params.append(param)
        else:
            sources.append(source)
            source_params.append(param)
    names = ", ".join(connection.ops.quote_name(field.column) for field in fields)
    sql = (
        f"INSERT INTO {connection.ops.quote_name(Timer._meta.db_table)} ({names}) "
        f"SELECT {', '.join(selects)} FROM ROWS FROM ({', '.join(sources)}) "
        f"AS r({', '.join(f'c{i}' for i in range(len(sources)))}) RETURNING id"
    )
    return sql, select_params + source_params


def _column(
    field: Any, values: list[Any], connection: Any, alias: str
) -> tuple[str, Any, str | None] | None:
    """Return ``(select expression, param, row source or None)`` for one column, or None.

    None means the column cannot go through an array (varying datetimes, say): the
    caller falls back to ``bulk_create``.
    """
    cast = field.db_type(connection).split("(")[0]
    if _uniform(field, values):
        return f"%s::{cast}", field.get_db_prep_save(values[0], connection), None
    if all(value is None or type(value) in _NUMBERS for value in values):
        # A numeric array literal parses faster than JSON text cast row by row.
        text = ",".join(map(str, values)) if None not in values else _with_nulls(values)
        return alias, f"{{{text}}}", f"unnest(%s::{cast}[])"
    try:
        param = json.dumps(values, allow_nan=False)
    except (TypeError, ValueError):
        return None
    if isinstance(field, models.JSONField):
        select = f"NULLIF({alias}, 'null'::jsonb)" if field.null else alias
        return select, param, "jsonb_array_elements(%s::jsonb)"
    if all(value is None or isinstance(value, int | float | str) for value in values):
        return f"{alias}::{cast}", param, "jsonb_array_elements_text(%s::jsonb)"
    return None


def _with_nulls(values: list[Any]) -> str:
    return ",".join("NULL" if value is None else str(value) for value in values)


def _uniform(field: models.Field[Any, Any], values: list[Any]) -> bool:
    first = values[0]
    if isinstance(field, models.JSONField):
        # Equality is too loose for JSON ([1] == [True]); only trust "all None / all {}".
        return all(v is None for v in values) or all(type(v) is dict and not v for v in values)
    return values.count(first) == len(values)
