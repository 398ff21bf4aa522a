"""Cron and interval schedules: their calendar, last run, and pause / resume / run now.

A schedule row is read-only here: changing its calendar must also replace its pending
occurrence timer, which ``durable.schedules.update()`` does in one transaction. Deleting
goes through ``durable.schedules.delete()`` for the same reason (a declared schedule
comes back at the next worker start unless its declaration is removed too).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import ngettext

import durable
from durable.admin import base
from durable.exceptions import DurableError
from durable.models import CronSchedule
from durable.scheduling import operations


@admin.register(CronSchedule)
class CronScheduleAdmin(base.ObjectActions, admin.ModelAdmin):
    """Schedules: read-only rows; pause, resume and run now as actions."""

    list_display = (
        "name",
        "calendar",
        "enabled",
        "next_run",
        "last_run",
        "last_status",
        "runs",
    )
    list_filter = ("enabled", "last_status", "kind", "source")
    search_fields = ("name", "handler")
    ordering = ("name",)
    actions = ("pause", "resume", "run_now")
    object_actions = {"pause": "Pause", "resume": "Resume", "run_now": "Run now"}
    fieldsets = (
        (
            None,
            {"fields": ("name", "handler", "kwargs", "calendar", "enabled", "source", "atomic")},
        ),
        ("Policies", {"fields": ("catch_up", "overlap", "grace_ms")}),
        ("Next", {"fields": ("next_run", "running")}),
        (
            "Last run",
            {
                "fields": (
                    "last_run",
                    "last_status",
                    "last_duration_ms",
                    "last_error",
                    "fired_count",
                    "failed_count",
                    "skipped_count",
                )
            },
        ),
        ("Declaration", {"fields": ("declaration", "created", "updated")}),
    )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [name for _, group in self.fieldsets for name in group["fields"]]

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # declared in code, settings or with durable.schedules.create()

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # View-only pages (a saved form would bypass durable.schedules.update()); the
        # class-level answer is the user's permission, which the actions need.
        return obj is None and super().has_change_permission(request)

    def delete_model(self, request: HttpRequest, obj: CronSchedule) -> None:
        durable.schedules.delete(obj.name)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[CronSchedule]) -> None:
        for name in queryset.values_list("name", flat=True):
            durable.schedules.delete(name)

    # Times to the second (Django's default format stops at minutes; schedules can run
    # every second). The next run is read from next_ms, which may hold an instant
    # past datetime's range (base.ms_display says so instead of failing).

    @admin.display(description="next run", ordering="next_ms")
    def next_run(self, obj: CronSchedule) -> str:
        return base.ms_display(obj.next_ms)

    @admin.display(description="last run", ordering="last_run_at")
    def last_run(self, obj: CronSchedule) -> str:
        return base.local(obj.last_run_at)

    @admin.display(description="created at")
    def created(self, obj: CronSchedule) -> str:
        return base.local(obj.created_at)

    @admin.display(description="updated at")
    def updated(self, obj: CronSchedule) -> str:
        return base.local(obj.updated_at)

    @admin.display(description="runs")
    def runs(self, obj: CronSchedule) -> str:
        return f"{obj.fired_count} ok · {obj.failed_count} failed · {obj.skipped_count} skipped"

    @admin.display(description="calendar")
    def calendar(self, obj: CronSchedule) -> str:
        if obj.kind == CronSchedule.Kind.CRON:
            return f"{obj.expression} ({obj.timezone})"
        return f"every {base.duration((obj.interval_ms or 0) / 1000)}"

    # -- actions ------------------------------------------------------------------------

    @admin.action(description="Pause selected schedules", permissions=["change"])
    def pause(self, request: HttpRequest, queryset: QuerySet[CronSchedule]) -> None:
        self._toggle(request, queryset, durable.schedules.pause, enabled=True)

    @admin.action(description="Resume selected schedules", permissions=["change"])
    def resume(self, request: HttpRequest, queryset: QuerySet[CronSchedule]) -> None:
        self._toggle(request, queryset, durable.schedules.resume, enabled=False)

    def _toggle(
        self, request: HttpRequest, queryset: QuerySet[CronSchedule], call: Any, *, enabled: bool
    ) -> None:
        names = dict(queryset.values_list("pk", "name"))
        todo = [pk for pk, on in queryset.values_list("pk", "enabled") if on is enabled]
        done, _ = base.each(todo, lambda pk: call(names[pk]), lambda row: True)
        verb = "paused" if enabled else "resumed"
        skipped = sorted(names[pk] for pk in names.keys() - set(done))
        base.report(self, request, done, skipped, verb, f"already {verb}")

    @admin.action(
        description="Run selected schedules now (once, off calendar)", permissions=["change"]
    )
    def run_now(self, request: HttpRequest, queryset: QuerySet[CronSchedule]) -> None:
        names = dict(queryset.values_list("pk", "name"))
        timers = {
            pk: base.attempt(lambda pk=pk: operations.run_schedule_now(names[pk])) for pk in names
        }
        queued = [pk for pk, timer in timers.items() if not isinstance(timer, DurableError)]
        missing = sorted(names[pk] for pk in names.keys() - set(queued))
        base.report(self, request, queued, missing, "queued a run of", "deleted meanwhile")
        if queued:
            listed = ", ".join(f"{names[pk]} → timer {timers[pk].pk}" for pk in queued)
            them = ngettext("it", "them", len(queued))
            self.message_user(request, f"A worker runs {them} shortly ({listed}).")
