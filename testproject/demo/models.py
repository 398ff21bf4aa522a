"""Rows the demo and the tests write from handlers, to prove exactly-once effects."""

from django.db import models


class FireRecord(models.Model):
    """One row per handler execution: counting rows per key proves exactly-once."""

    key = models.CharField(max_length=200, db_index=True)
    fired_at_ms = models.BigIntegerField()
    due_at_ms = models.BigIntegerField(null=True)

    def __str__(self) -> str:
        return f"{self.key} @ {self.fired_at_ms}"
