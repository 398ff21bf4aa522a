"""Which of ``durable_timer``'s indexes a row version enters, by state (issue 16).

Marking a timer fired is the one write every fire makes and is never a HOT update, so
each index its new version enters costs every fire an index insert and its WAL. A keyless
fired row must enter only the primary key and the done index that retention reads; the
readers of other states and of key prefixes, and the key's uniqueness, have partial
indexes that leave it out. Evaluated from the catalog: an index without a
predicate holds every row version; a partial one, those its predicate matches.
"""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from durable.models import Timer, TimerState

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]


def indexes_holding(timer_id: int) -> set[str]:
    """Names of the indexes of ``durable_timer`` that hold the row ``timer_id``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'durable_timer'::regclass"
        )
        found = set()
        for name, predicate in cursor.fetchall():
            where = f"id = %s AND ({predicate or 'true'})"
            cursor.execute(f"SELECT EXISTS (SELECT 1 FROM durable_timer WHERE {where})", [timer_id])
            if cursor.fetchone()[0]:
                found.add(name)
    return found


def timer(state: str, key: str | None = None) -> int:
    row = Timer.objects.create(shard=0, bucket=0, fire_at_ms=0, target="x.y", state=state, key=key)
    return row.pk


ALWAYS = {"durable_timer_pkey"}


def test_a_fired_keyless_row_enters_only_the_primary_key_and_the_done_index():
    assert indexes_holding(timer(TimerState.FIRED)) == ALWAYS | {"durable_timer_done_idx"}


def test_a_pending_row_enters_the_loader_and_the_readers_by_state():
    assert indexes_holding(timer(TimerState.PENDING)) == ALWAYS | {
        "durable_timer_pending_idx",
        "durable_timer_unfired_idx",
    }


def test_dead_letters_and_keyed_rows_keep_their_readers_indexes():
    assert "durable_timer_unfired_idx" in indexes_holding(timer(TimerState.FAILED))
    keyed = indexes_holding(timer(TimerState.FIRED, key="k:1"))
    assert {"durable_timer_key_prefix_idx", "durable_timer_key_uniq"} <= keyed
    assert "durable_timer_key_prefix_idx" not in indexes_holding(timer(TimerState.FIRED))


def test_a_key_is_still_unique_and_keyless_rows_never_conflict():
    timer(TimerState.PENDING, key="once")
    timer(TimerState.PENDING)
    timer(TimerState.PENDING)  # NULL keys: no conflict
    with pytest.raises(IntegrityError), transaction.atomic():
        timer(TimerState.FIRED, key="once")
