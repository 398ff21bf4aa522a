# Timer.key is unique where set (issue 16, docs/benchmarks.md): a partial unique index
# (key) WHERE key IS NOT NULL replaces the column's UNIQUE constraint. Same guarantee
# (NULL keys never conflicted), but the constraint's index held an entry for every row
# version, keyless or not, and marking a timer fired is never a HOT update.
#
# On PostgreSQL the new index is built CONCURRENTLY (the migration is not atomic; an
# invalid leftover of an interrupted build is dropped and rebuilt) before the old
# constraint goes, so a duplicate key is refused all along. On SQLite the column's
# UNIQUE is part of the table: the usual table rebuild, then the partial index.

from django.db import migrations, models
from django.db.models import Q

OLD_CONSTRAINT = "durable_timer_key_key"  # PostgreSQL's name for 0001's UNIQUE column
UNIQUE_KEY = models.UniqueConstraint(
    fields=["key"], name="durable_timer_key_uniq", condition=Q(key__isnull=False)
)


def _key_field(unique):
    field = models.CharField(
        max_length=255, null=True, blank=True, unique=unique, help_text="idempotency key"
    )
    field.set_attributes_from_name("key")
    return field


def _alter_key(schema_editor, timer, unique):
    """Make ``key`` a UNIQUE column or not (SQLite rebuilds the table).

    Both fields are built here: a RunPython inside SeparateDatabaseAndState sees the
    state before this migration's, whichever way it runs.
    """
    old, new = _key_field(unique=not unique), _key_field(unique=unique)
    old.model = new.model = timer
    schema_editor.alter_field(timer, old, new)


def _index_validity(schema_editor, name):
    """None if no index ``name`` exists, else whether it is valid (PostgreSQL)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = %s AND c.relnamespace = to_regnamespace(current_schema())",
            [name],
        )
        row = cursor.fetchone()
    return None if row is None else row[0]


def _build_concurrently(schema_editor, name, sql):
    valid = _index_validity(schema_editor, name)
    if valid:
        return
    if valid is False:  # left by an interrupted CREATE INDEX CONCURRENTLY
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
    schema_editor.execute(sql)


def forwards(apps, schema_editor):
    timer = apps.get_model("durable", "Timer")
    if schema_editor.connection.vendor == "postgresql":
        _build_concurrently(
            schema_editor,
            UNIQUE_KEY.name,
            f'CREATE UNIQUE INDEX CONCURRENTLY "{UNIQUE_KEY.name}" ON durable_timer (key) '
            "WHERE key IS NOT NULL",
        )
        schema_editor.execute(
            f'ALTER TABLE durable_timer DROP CONSTRAINT IF EXISTS "{OLD_CONSTRAINT}"'
        )
        return
    _alter_key(schema_editor, timer, unique=False)
    schema_editor.add_constraint(timer, UNIQUE_KEY)


def backwards(apps, schema_editor):
    timer = apps.get_model("durable", "Timer")
    if schema_editor.connection.vendor == "postgresql":
        _build_concurrently(
            schema_editor,
            OLD_CONSTRAINT,
            f'CREATE UNIQUE INDEX CONCURRENTLY "{OLD_CONSTRAINT}" ON durable_timer (key)',
        )
        if not _has_constraint(schema_editor, OLD_CONSTRAINT):
            schema_editor.execute(
                f'ALTER TABLE durable_timer ADD CONSTRAINT "{OLD_CONSTRAINT}" '
                f'UNIQUE USING INDEX "{OLD_CONSTRAINT}"'
            )
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{UNIQUE_KEY.name}"')
        return
    schema_editor.remove_constraint(timer, UNIQUE_KEY)
    _alter_key(schema_editor, timer, unique=True)


def _has_constraint(schema_editor, name):
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT 1 FROM pg_constraint WHERE conname = %s "
            "AND conrelid = 'durable_timer'::regclass",
            [name],
        )
        return cursor.fetchone() is not None


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable", "0016_timer_lookup_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="timer",
                    name="key",
                    field=models.CharField(
                        blank=True, help_text="idempotency key", max_length=255, null=True
                    ),
                ),
                migrations.AddConstraint(model_name="timer", constraint=UNIQUE_KEY),
            ],
            database_operations=[migrations.RunPython(forwards, backwards)],
        ),
    ]
