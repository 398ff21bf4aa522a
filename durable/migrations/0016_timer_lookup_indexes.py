# Fewer index entries per fire (issue 16, docs/benchmarks.md): marking a timer fired is
# never a HOT update, so its new row version entered every index whose predicate it
# matched. Two of those served no reader of fired rows:
#
# - durable_timer_state_idx (state, fire_at_ms) becomes durable_timer_unfired_idx, the
#   same columns for every state but fired (fired rows are read by the done index or id);
# - Django's implicit durable_timer_key_2574eae8_like (varchar_pattern_ops twin of the
#   key's unique index, one entry per row version, keyless or not) becomes
#   durable_timer_key_prefix_idx, the same for rows that have a key.
#
# On PostgreSQL the indexes are built and dropped CONCURRENTLY (the migration is not
# atomic): a large durable_timer stays writable, and every new index exists before the
# old one goes. A build interrupted half way leaves an invalid index; running the
# migration again drops and rebuilds it. Other databases get plain CREATE/DROP INDEX
# (SQLite has no _like index).

from django.db import migrations, models
from django.db.models import Q

LIKE_INDEX = "durable_timer_key_2574eae8_like"

STATE_INDEX = models.Index(fields=["state", "fire_at_ms"], name="durable_timer_state_idx")
UNFIRED_INDEX = models.Index(
    fields=["state", "fire_at_ms"],
    name="durable_timer_unfired_idx",
    condition=Q(state__in=["pending", "firing", "failed", "canceled"]),
)
KEY_PREFIX_INDEX = models.Index(
    fields=["key"],
    name="durable_timer_key_prefix_idx",
    opclasses=["varchar_pattern_ops"],
    condition=Q(key__isnull=False),
)


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


def _create(schema_editor, model, index):
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, index)
        return
    valid = _index_validity(schema_editor, index.name)
    if valid:
        return
    if valid is False:  # left by an interrupted CREATE INDEX CONCURRENTLY
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
    schema_editor.execute(index.create_sql(model, schema_editor, concurrently=True))


def _drop(schema_editor, model, name):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
    elif name != LIKE_INDEX:
        schema_editor.execute(schema_editor._delete_index_sql(model, name))


def _like_index(schema_editor, model):
    """Django's ``_like`` twin of the key's unique index (PostgreSQL only)."""
    field = model._meta.get_field("key")
    return schema_editor._create_like_index_sql(model, field)


def forwards(apps, schema_editor):
    timer = apps.get_model("durable", "Timer")
    _create(schema_editor, timer, UNFIRED_INDEX)
    _create(schema_editor, timer, KEY_PREFIX_INDEX)
    _drop(schema_editor, timer, STATE_INDEX.name)
    _drop(schema_editor, timer, LIKE_INDEX)


def backwards(apps, schema_editor):
    timer = apps.get_model("durable", "Timer")
    _create(schema_editor, timer, STATE_INDEX)
    if (
        schema_editor.connection.vendor == "postgresql"
        and _index_validity(schema_editor, LIKE_INDEX) is None
    ):
        sql = str(_like_index(schema_editor, timer))
        schema_editor.execute(sql.replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY", 1))
    _drop(schema_editor, timer, KEY_PREFIX_INDEX.name)
    _drop(schema_editor, timer, UNFIRED_INDEX.name)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("durable", "0015_clock_stamps"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name="timer", name="durable_timer_state_idx"),
                migrations.AddIndex(model_name="timer", index=UNFIRED_INDEX),
                migrations.AddIndex(model_name="timer", index=KEY_PREFIX_INDEX),
            ],
            database_operations=[migrations.RunPython(forwards, backwards)],
        ),
    ]
