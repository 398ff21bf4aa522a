"""Django app configuration for durable."""

from __future__ import annotations

from django.apps import AppConfig, apps

from durable.core.clock import Clock, SystemClock


class DurableConfig(AppConfig):
    """Registers durable's models and checks, and holds the process's clock.

    The clock lives here, built once in :meth:`ready`, rather than in a module global:
    code that needs the time calls :func:`current_clock`, and tests swap it with
    :func:`durable.testing.override_clock`.
    """

    name = "durable"
    verbose_name = "Durable execution"
    default_auto_field = "django.db.models.BigAutoField"
    clock: Clock

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

        self.clock = SystemClock()
        _sqlite_defaults()


def _sqlite_defaults() -> None:
    """The options a worker beside a web process needs on SQLite (durable.storage.sqlite)."""
    from django.conf import settings

    from durable.storage.sqlite import apply_defaults

    alias = (getattr(settings, "DURABLE", None) or {}).get("DATABASE", "default")
    database = settings.DATABASES.get(alias) if isinstance(alias, str) else None
    if isinstance(database, dict):
        apply_defaults(database)


def current_clock() -> Clock:
    """Return the clock scheduling code reads the time from."""
    config = apps.get_app_config("durable")
    assert isinstance(config, DurableConfig)
    return config.clock
