"""Django app configuration for durable."""

from __future__ import annotations

from django.apps import AppConfig

from durable.core.clock import current_clock

__all__ = ["DurableConfig", "current_clock"]


class DurableConfig(AppConfig):
    """Registers durable's models, checks and kinds, and applies its SQLite defaults.

    The process's clock lives in :mod:`durable.core.clock` (``current_clock``); tests swap
    it with :func:`durable.testing.override_clock`.
    """

    name = "durable"
    verbose_name = "Durable execution"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from importlib.util import find_spec

        from durable import checks  # noqa: F401  (registers the system checks)
        from durable.dispatch import celery  # noqa: F401  (registers the "celery" kind)
        from durable.scheduling import occurrences  # noqa: F401  (registers the "cron" kind)
        from durable.workflows import resume  # noqa: F401  (registers the "workflow" kind)

        # The "task" kind needs a Django Tasks API: django.tasks (Django 6) or the
        # django-tasks backport (Django 5.2); without one, Django tasks are simply absent.
        if find_spec("django.tasks") or find_spec("django_tasks"):
            from durable import tasks  # noqa: F401  (registers the "task" kind)

        _sqlite_defaults()


def _sqlite_defaults() -> None:
    """The options a worker beside a web process needs on SQLite (durable.storage.sqlite)."""
    from django.conf import settings

    from durable.storage.sqlite import apply_defaults

    alias = (getattr(settings, "DURABLE", None) or {}).get("DATABASE", "default")
    database = settings.DATABASES.get(alias) if isinstance(alias, str) else None
    if isinstance(database, dict):
        apply_defaults(database)
