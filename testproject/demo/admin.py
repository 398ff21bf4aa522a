"""The demo's admin: orders show the timelines of their ``fulfil`` runs
(``durable.admin.RunTimelineMixin``)."""

from django.contrib import admin

from durable.admin import RunTimelineMixin
from testproject.demo.models import Order


@admin.register(Order)
class OrderAdmin(RunTimelineMixin, admin.ModelAdmin):
    """Orders, with their workflow runs' timelines on each order's page."""

    list_display = ("id", "customer", "status", "total_cents", "created_at")
    timeline_runs = 3
