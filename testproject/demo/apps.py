"""The demo app: a small live workload for ``make demo`` and models the tests count with."""

from django.apps import AppConfig


class DemoConfig(AppConfig):
    """Demo workload for durable."""

    name = "testproject.demo"
    label = "demo"
    default_auto_field = "django.db.models.BigAutoField"
