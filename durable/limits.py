"""The row that holds one concurrency key: its lock, its limits, its rate's log.

Admission to a key (:mod:`durable.storage.concurrency`) locks this row, so two
transactions never decide about the same key at once: out-of-order commits cannot admit
more than the limit. The row is created on first use and never deleted (a key is a few
bytes; deleting it would race with the next admission's insert).
"""

from __future__ import annotations

from django.db import models


class ConcurrencyKey(models.Model):
    """One concurrency key of a handler: ``"<handler dotted name>:<key>"``."""

    name = models.CharField(max_length=255, primary_key=True)
    max_concurrency = models.PositiveIntegerField(
        null=True, blank=True, help_text="its handler's max_concurrency when last admitted to"
    )
    rate_limit = models.CharField(
        max_length=20, blank=True, default="", help_text="its handler's rate_limit ('' none)"
    )
    recent = models.JSONField(
        default=list, blank=True, help_text="epoch ms of its last starts (the rate's window)"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        app_label = "durable"

    def __str__(self) -> str:
        return self.name
