# durable's own timestamps come from its injected clock (durable.core.clock), no longer
# from Django's auto_now / auto_now_add: those read the wall clock, and overwrote a time
# the code gave (a checkpoint's, on SQLite). ClockStampField's column is a DateTimeField's,
# so the schema does not change: state only (on SQLite an AlterField would copy each
# table once per field).

from django.db import migrations

import durable.fields

STAMPED = {
    "concurrencykey": ("updated_at",),
    "cronschedule": ("created_at", "updated_at"),
    "shardlease": ("updated_at",),
    "timer": ("created_at", "updated_at"),
    "workflowrun": ("created_at", "updated_at"),
    "workflowsignal": ("created_at",),
    "workflowstep": ("created_at", "updated_at"),
}


class Migration(migrations.Migration):
    dependencies = [
        ("durable", "0014_concurrency"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name=model,
                    name=name,
                    field=durable.fields.ClockStampField(blank=True, editable=False),
                )
                for model, names in STAMPED.items()
                for name in names
            ]
        )
    ]
