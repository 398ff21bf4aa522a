"""One row per thing durable ran for the smoke test; the driver counts them by ``what``."""

from __future__ import annotations

from django.db import models


class Fired(models.Model):
    what = models.CharField(max_length=200)
    created = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.what
