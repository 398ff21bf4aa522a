"""One timer in one statement: ``schedule()``'s write and its NOTIFY, one round trip.

The general path (:func:`durable.storage.timers.insert_timer`, then
:func:`~durable.storage.timers.announce`) sends the ORM's INSERT and a separate
``SELECT pg_notify(...)``, inside an atomic block that, in autocommit mode, adds a BEGIN
and a COMMIT: four round trips for one timer, and the ORM compiles the INSERT anew each
call. On PostgreSQL this module sends one statement instead::

    WITH t AS (INSERT INTO durable_timer (...) VALUES (...) [ON CONFLICT DO NOTHING]
               RETURNING id)
    SELECT id, pg_notify(channel, '<shard>,' || id || ',<fire_at_ms>') FROM t

Nothing is weakened. The row is written in the caller's transaction when there is one;
in autocommit mode the statement is its own transaction, and one statement is atomic,
so no BEGIN/COMMIT pair is needed around it. ``pg_notify`` stays transactional: it is
delivered when that transaction commits, never if it rolls back, and only for a row the
INSERT returned (a taken key returns none, so it is not announced again). The columns and
their values are Django's: the statement is built once from ``Timer``'s fields and each
value goes through the field's ``get_db_prep_save``, as the ORM's INSERT does. It binds on
the server (:func:`durable.storage.statements.cursor`): no quoting of 27 values in Python,
and prepared where the connection prepares (a worker's, where handlers schedule).

Used only where it is the same as the general path: PostgreSQL, outside a firing batch's
:func:`~durable.storage.notify.collecting` block (which gathers notices for one
``pg_notify``), and with nothing listening to ``Timer``'s ``pre_save``/``post_save``
(``save()`` sends them; so the ORM path runs for such a listener, as in
:func:`~durable.storage.timers.new_timer`).
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache
from typing import Any

from django.db import IntegrityError, connections, models, transaction
from django.db.models.signals import post_save, pre_save

from durable.conf import DurableSettings
from durable.models import Timer, TimerState
from durable.storage import statements
from durable.storage import timers as store
from durable.storage.bulk import stamp_unset
from durable.storage.notify import CHANNEL, collecting_now

_PENDING = TimerState.PENDING.value


def insert_announced(
    db: str, timer: Timer, conf: DurableSettings, now_ms: int
) -> tuple[Timer, bool]:
    """Insert an unsaved timer and announce it if near-term; return ``(timer, created)``.

    With a key that exists, nothing is written or announced and the existing row is
    returned, as :func:`~durable.storage.timers.insert_timer` does. Runs in the caller's
    transaction, if any (see the module docstring for why none is opened otherwise).
    """
    connection = connections[db]
    if connection.vendor != "postgresql" or collecting_now() or _save_signals():
        with transaction.atomic(using=db, savepoint=False):
            timer, created = store.insert_timer(db, timer)
            if created:
                store.announce(db, [timer], now_ms)
        return timer, created
    near = (
        conf.NOTIFY
        and timer.state == _PENDING
        and timer.fire_at_ms < now_ms + (conf.HORIZON_BUCKETS << conf.BUCKET_SHIFT)
    )
    sql, fields = _statement(db, timer.key is not None, near)
    stamp_unset([timer])  # what ClockStampField.pre_save does, from the injected clock
    state = timer.__dict__
    params = []
    for name, plain, field in fields:
        value = state[name]
        # What get_db_prep_save returns for these anyway (see _PLAIN), without the calls.
        plain_value = value is None or type(value) is plain
        params.append(value if plain_value else field.get_db_prep_save(value, connection))
    if near:
        params += [CHANNEL, f"{timer.shard},", f",{timer.fire_at_ms}"]
    # Inside an atomic block, keep its bookkeeping (a failed statement dooms the block,
    # as it would through the ORM); in autocommit mode the statement commits itself.
    scope = transaction.atomic(using=db, savepoint=False) if connection.in_atomic_block else None
    with scope or nullcontext(), statements.cursor(db) as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:  # the key exists; the unique index made us wait for its inserter
        key = str(timer.key)
        existing = store.by_keys(db, [key]).get(key)
        if existing is None:  # as insert_timer reports it
            raise IntegrityError(f"timer with key {key!r} was neither inserted nor found")
        return existing, False
    state[Timer._meta.pk.attname] = row[0]
    timer._state.adding = False
    timer._state.db = db
    return timer, True


def _save_signals() -> bool:
    return bool(pre_save.receivers or post_save.receivers) and (
        pre_save.has_listeners(Timer) or post_save.has_listeners(Timer)
    )


#: Field classes whose ``get_db_prep_save`` returns a value of this exact type unchanged
#: (exact classes only: a subclass may convert). Other values go through the field.
_PLAIN: dict[type[Any], type[Any]] = {
    models.BigIntegerField: int,
    models.IntegerField: int,
    models.PositiveIntegerField: int,
    models.PositiveSmallIntegerField: int,
    models.SmallIntegerField: int,
    models.FloatField: float,
    models.CharField: str,
}


@cache
def _statement(db: str, keyed: bool, announce: bool) -> tuple[str, list[tuple[str, Any, Any]]]:
    """The SQL for one timer and, per value parameter in order, ``(attname, plain type,
    field)``. Cached per alias and variant: the text depends only on ``Timer``'s columns.
    """
    ops = connections[db].ops
    fields = [f for f in Timer._meta.concrete_fields if not f.primary_key]
    preps = [(f.attname, _PLAIN.get(type(f), type(None)), f) for f in fields]
    names = ", ".join(ops.quote_name(f.column) for f in fields)
    values = ", ".join(["%s"] * len(fields))
    table = ops.quote_name(Timer._meta.db_table)
    pk = ops.quote_name(Timer._meta.pk.column)
    conflict = " ON CONFLICT DO NOTHING" if keyed else ""
    insert = f"INSERT INTO {table} ({names}) VALUES ({values}){conflict} RETURNING {pk}"
    if not announce:
        return insert, preps
    # The payload is notify.py's "<shard>,<timer id>,<fire_at_ms>".
    return (
        f"WITH t AS ({insert}) "
        f"SELECT {pk}, pg_notify(%s, %s::text || {pk}::text || %s::text) FROM t",
        preps,
    )
