"""Queries of cron schedules: the ``CronSchedule`` row and its occurrence timers.

Everything runs on the alias it is given, inside the caller's transaction. The only
read of ``durable_cronschedule`` on the fire path is :func:`lock` (and the resolver's
:func:`is_atomic`), once per occurrence fired: nothing here polls the table.

Occurrence timers are ordinary ``Timer`` rows: kind ``cron``, target the schedule's name,
key ``cron:<name>:<epoch_ms>`` (the unique index makes each occurrence fire once per
cluster), routed to the shard of ``cron:<name>`` so that one schedule's whole chain
lives on one shard and moves with its lease.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from django.db import connections

from durable.conf import get_settings
from durable.core.clock import current_datetime
from durable.core.sharding import bucket_of, shard_for
from durable.core.timeutil import ms_to_datetime
from durable.models import CronSchedule, Timer, TimerKind, TimerState
from durable.storage.timers import announce, insert_timer, new_timer

# An occurrence timer only fails when durable's own code does (a user handler's error
# is recorded on the schedule, not raised). Retry for hours rather than dead-letter it:
# a dead occurrence timer would stop the chain until the next sync repairs it.
OCCURRENCE_MAX_ATTEMPTS = 100
OCCURRENCE_BACKOFF = (1.0, 300.0)


def occurrence_key(name: str, scheduled_ms: int) -> str:
    """The idempotency key of one occurrence's timer."""
    return f"cron:{name}:{scheduled_ms}"


def lock(db: str, name: str) -> CronSchedule | None:
    """Return schedule ``name`` locked for update (None if there is none)."""
    return CronSchedule.objects.using(db).select_for_update().filter(name=name).first()


def get(db: str, name: str) -> CronSchedule | None:
    """Return schedule ``name`` without locking it (None if there is none)."""
    return CronSchedule.objects.using(db).filter(name=name).first()


def is_atomic(db: str, name: str) -> bool | None:
    """Whether schedule ``name`` runs its handler in the firing transaction (None: gone)."""
    found = CronSchedule.objects.using(db).filter(name=name).values_list("atomic", flat=True)
    return next(iter(found), None)


def declared_names(db: str) -> list[str]:
    """Names of the schedules declared in code or settings that are still declared."""
    rows = CronSchedule.objects.using(db).filter(
        source__in=[CronSchedule.Source.CODE, CronSchedule.Source.SETTINGS],
        declaration__isnull=False,
    )
    return list(rows.order_by("name").values_list("name", flat=True))


def lock_many(db: str, names: Sequence[str]) -> dict[str, CronSchedule]:
    """Lock schedules ``names`` for update, in name order (no deadlock between batches)."""
    rows = CronSchedule.objects.using(db).select_for_update().filter(name__in=sorted(set(names)))
    return {row.name: row for row in rows.order_by("name")}


def insert(db: str, row: CronSchedule) -> CronSchedule:
    """Insert a new schedule row (``next_at`` follows ``next_ms``)."""
    row.next_at = None if row.next_ms is None else ms_to_datetime(row.next_ms)
    row.save(using=db, force_insert=True)
    return row


def save(db: str, row: CronSchedule, fields: Iterable[str]) -> None:
    """Write ``fields`` of a locked row (``next_at`` follows ``next_ms``; ``updated_at``
    is stamped from the injected clock)."""
    names = set(fields)
    if "next_ms" in names:
        row.next_at = None if row.next_ms is None else ms_to_datetime(row.next_ms)
        names.add("next_at")
    row.updated_at = current_datetime()
    row.save(using=db, update_fields=sorted(names | {"updated_at"}))


def delete(db: str, row: CronSchedule) -> None:
    """Delete a schedule row."""
    row.delete(using=db)


def insert_occurrence(
    db: str,
    name: str,
    scheduled_ms: int,
    now_ms: int,
    *,
    catch_up: bool | None = None,
    until_ms: int | None = None,
    then_ms: int | None = None,
) -> Timer:
    """Insert the timer of occurrence ``scheduled_ms`` (idempotent by key) and announce it.

    ``catch_up``/``until_ms``/``then_ms`` mark a timer of a decided ``fire_all`` backlog.
    """
    timer = occurrence_timer(
        name, scheduled_ms, catch_up=catch_up, until_ms=until_ms, then_ms=then_ms
    )
    timer, created = insert_timer(db, timer)
    if created:
        announce(db, [timer], now_ms)
    return timer


def occurrence_timer(
    name: str,
    scheduled_ms: int,
    *,
    catch_up: bool | None = None,
    until_ms: int | None = None,
    then_ms: int | None = None,
) -> Timer:
    """The unsaved timer of occurrence ``scheduled_ms`` of schedule ``name``."""
    conf = get_settings()
    kwargs: dict[str, Any] = {"scheduled_ms": scheduled_ms}
    extra = {"catch_up": catch_up, "until_ms": until_ms, "then_ms": then_ms}
    kwargs.update((key, value) for key, value in extra.items() if value is not None)
    return new_timer(
        shard=shard_for(f"cron:{name}", conf.SHARDS),
        bucket=bucket_of(scheduled_ms, conf.BUCKET_SHIFT),
        fire_at_ms=scheduled_ms,
        state=TimerState.PENDING,
        kind=TimerKind.CRON,
        target=name,
        args=[],
        kwargs=kwargs,
        key=occurrence_key(name, scheduled_ms),
        max_attempts=OCCURRENCE_MAX_ATTEMPTS,
        backoff_base_s=OCCURRENCE_BACKOFF[0],
        backoff_max_s=OCCURRENCE_BACKOFF[1],
    )


def drop_occurrence(db: str, name: str, scheduled_ms: int) -> bool:
    """Delete the pending timer of an occurrence; False if none, or a worker is firing it.

    Deleted rather than cancelled, so that the same occurrence can be scheduled again
    (resume, or a change back) under its unique key. A row a worker has locked to fire
    is skipped, not waited for: that fire finds the schedule moved on and does nothing,
    and waiting could deadlock (it locks the timer, then the schedule; we hold the
    schedule). On databases without row locks (SQLite) writers are serialized anyway.
    """
    rows = Timer.objects.using(db).filter(
        key=occurrence_key(name, scheduled_ms), state=TimerState.PENDING
    )
    if connections[db].features.has_select_for_update_skip_locked:
        rows = rows.select_for_update(skip_locked=True)
    ids = list(rows.values_list("id", flat=True))
    if not ids:
        return False
    Timer.objects.using(db).filter(id__in=ids, state=TimerState.PENDING).delete()
    return True


def occurrence_state(db: str, name: str, scheduled_ms: int) -> str | None:
    """State of the timer of occurrence ``scheduled_ms`` (None if there is no such row)."""
    found = Timer.objects.using(db).filter(key=occurrence_key(name, scheduled_ms))
    return next(iter(found.values_list("state", flat=True)), None)


def save_many(db: str, rows: list[CronSchedule], fields: Sequence[str]) -> None:
    """:func:`save` for many locked rows, the same ``fields`` of each, in one statement.

    ``UPDATE ... FROM (VALUES ...)`` on PostgreSQL; one save per row elsewhere.
    """
    if not rows:
        return
    connection = connections[db]
    if connection.vendor != "postgresql" or len(rows) == 1:
        for row in rows:
            save(db, row, fields)
        return
    names = sorted({*fields, "updated_at"} | ({"next_at"} if "next_ms" in fields else set()))
    now = current_datetime()
    for row in rows:
        row.next_at = None if row.next_ms is None else ms_to_datetime(row.next_ms)
        row.updated_at = now
    columns = [CronSchedule._meta.get_field(name) for name in names]
    pk = CronSchedule._meta.pk
    casts = [f"%s::{pk.db_type(connection)}"]
    casts += [f"%s::{column.db_type(connection)}" for column in columns]
    values = ", ".join(f"({', '.join(casts)})" for _ in rows)
    params: list[Any] = []
    for row in rows:
        params.append(pk.get_db_prep_save(row.pk, connection))
        params += [c.get_db_prep_save(getattr(row, c.attname), connection) for c in columns]
    quote = connection.ops.quote_name
    aliases = ["pk_", *(c.column for c in columns)]
    sets = ", ".join(f"{quote(c.column)} = v.{quote(c.column)}" for c in columns)
    sql = (
        f"UPDATE {quote(CronSchedule._meta.db_table)} AS t SET {sets} "
        f"FROM (VALUES {values}) AS v({', '.join(quote(a) for a in aliases)}) "
        f"WHERE t.{quote(pk.column)} = v.{quote('pk_')}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
