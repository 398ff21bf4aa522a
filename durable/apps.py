"""Django app configuration for durable."""

from __future__ import annotations

from django.apps import AppConfig


class DurableConfig(AppConfig):
    """Registers durable's models, system checks and admin."""

    name = "durable"
    verbose_name = "Durable execution"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from durable import checks  # noqa: F401  (registers the system checks)
