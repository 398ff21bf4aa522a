"""App config: imports the modules that declare handlers and workflows at start-up."""

from __future__ import annotations

from django.apps import AppConfig


class SmokeappConfig(AppConfig):
    name = "smokeapp"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # What the docs advise for declarations outside the autodiscovered modules: the
        # worker then knows them however it resolves names (by import or by registry).
        from smokeapp import handlers, workflows  # noqa: F401
