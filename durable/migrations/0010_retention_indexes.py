# Retention pruning of finished workflow runs (durable.storage.retention) finds the
# oldest finished top-level runs through this index; without it every pruning pass
# would read every finished run.

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("durable", "0009_signal_kind"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                condition=models.Q(
                    ("parent__isnull", True), ("state__in", ["completed", "failed", "canceled"])
                ),
                fields=["finished_at"],
                name="durable_wfrun_done_idx",
            ),
        ),
    ]
