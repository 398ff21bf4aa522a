"""Workflow runs, their recorded steps and their signals.

A run's page shows its latest :data:`INLINE_ROWS` steps and signals inline (a run can
record thousands) with links to the full, filtered lists. Lists sort by creation (the
``created_at`` index) and filter by state and by workflow name (the ``(state, name)``
and ``(name, created_at)`` indexes); the name filter lists the registered workflows
rather than asking the table for its distinct names (each installed app's ``workflows``
module is imported for that, as the ``crons`` modules are).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.db.models import Q, QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest, HttpResponse
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.module_loading import autodiscover_modules

import durable
from durable.admin import base, timelines
from durable.admin.forms import SignalForm
from durable.models import WorkflowRun, WorkflowSignal, WorkflowStep
from durable.workflows import operations
from durable.workflows.registry import workflows

#: Steps and signals shown on a run's page; the rest are one click away.
INLINE_ROWS = 50


class WorkflowNameFilter(admin.SimpleListFilter):
    """Runs of one workflow; the choices come from the registry, not from the table."""

    title = "workflow"
    parameter_name = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # Workflows on model methods register when models load; module-level ones when
        # their module is imported: import each app's ``workflows`` module, as the
        # crons modules are.
        autodiscover_modules("workflows")
        names = set(workflows.names())
        if self.value():
            names.add(str(self.value()))
        return [(name, name.rsplit(".", 1)[-1]) for name in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(name=self.value()) if self.value() else queryset


class LatestRowsFormSet(BaseInlineFormSet):  # type: ignore[type-arg]
    """An inline formset showing only the first :data:`INLINE_ROWS` rows of its ordering."""

    def get_queryset(self) -> Any:
        if not hasattr(self, "_limited"):
            self._limited = super().get_queryset()[:INLINE_ROWS]
        return self._limited


class _HistoryInline(admin.TabularInline):  # type: ignore[type-arg]
    formset = LatestRowsFormSet
    extra = 0
    max_num = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class StepInline(_HistoryInline):
    """The run's latest recorded steps, newest first."""

    model = WorkflowStep
    ordering = ("-seq",)
    fields = ("seq", "kind", "name", "status", "attempts", "result_short", "wake", "error")
    readonly_fields = fields
    verbose_name_plural = f"steps (latest {INLINE_ROWS}, newest first)"

    @admin.display(description="result")
    def result_short(self, obj: WorkflowStep) -> str:
        return base.short_json(obj.result)

    @admin.display(description="wakes / retries at")
    def wake(self, obj: WorkflowStep) -> str:
        return base.ms_display(obj.wake_ms) if obj.wake_ms is not None else ""


class SignalInline(_HistoryInline):
    """The run's latest signals, newest first."""

    model = WorkflowSignal
    ordering = ("-id",)
    fields = ("name", "payload_short", "created_at", "consumed_at", "consumed_seq")
    readonly_fields = fields
    verbose_name_plural = f"signals (latest {INLINE_ROWS}, newest first)"

    @admin.display(description="payload")
    def payload_short(self, obj: WorkflowSignal) -> str:
        return base.short_json(obj.payload)


@admin.register(WorkflowRun)
class WorkflowRunAdmin(base.ObjectActions, base.ReadOnlyRows, base.BigTable, admin.ModelAdmin):
    """Runs: read-only; cancel, retry and signal them as actions."""

    list_display = ("id", "workflow", "state", "bound_to", "created_at", "updated_at", "retries")
    list_filter = ("state", WorkflowNameFilter)
    ordering = ("-created_at",)
    sortable_by = ("created_at",)
    search_fields = ("id",)
    search_help_text = "A run id or its prefix, a workflow name, or app_label.model:pk."
    raw_id_fields = ("parent",)
    inlines = (StepInline, SignalInline)
    actions = ("cancel_runs", "retry_runs", "send_signal")
    object_actions = {
        "cancel_runs": "Cancel run",
        "retry_runs": "Retry (if failed)",
        "send_signal": "Send a signal…",
    }
    fieldsets = (
        (None, {"fields": ("id", "name", "state", "shard", "bound_object", "parent_link")}),
        ("Progress", {"fields": ("wait", "replays", "retries", "created_at", "updated_at")}),
        ("Data", {"fields": ("args_json", "kwargs_json", "result_json", "error")}),
        ("History", {"fields": ("history", "finished_at")}),
        ("Timeline", {"fields": ("timeline",), "classes": ("durable-runs",)}),
    )

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [name for _, group in self.fieldsets for name in group["fields"]]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun], search_term: str
    ) -> tuple[QuerySet[WorkflowRun], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        label, sep, pk = term.partition(":")
        if sep and "." in label and " " not in term:
            return queryset.filter(model_label=label.lower(), object_pk=pk), False
        return queryset.filter(Q(pk__startswith=term) | Q(name=term)), False

    # -- columns ------------------------------------------------------------------------

    @admin.display(description="workflow", ordering="name")
    def workflow(self, obj: WorkflowRun) -> str:
        return obj.name.rsplit(".", 1)[-1]

    @admin.display(description="bound to")
    def bound_to(self, obj: WorkflowRun) -> str:
        return f"{obj.model_label}:{obj.object_pk}" if obj.model_label else ""

    @admin.display(description="bound to")
    def bound_object(self, obj: WorkflowRun) -> str:
        if not obj.model_label:
            return "-"
        app_label, _, model = obj.model_label.partition(".")
        try:
            url = reverse(f"admin:{app_label}_{model}_change", args=[quote(obj.object_pk)])
        except NoReverseMatch:
            return self.bound_to(obj)
        return format_html('<a href="{}">{}</a>', url, self.bound_to(obj))

    @admin.display(description="parent run")
    def parent_link(self, obj: WorkflowRun) -> str:
        if obj.parent_id is None:
            return "-"
        url = reverse("admin:durable_workflowrun_change", args=[quote(obj.parent_id)])
        return format_html('<a href="{}">{}</a>', url, obj.parent_id)

    @admin.display(description="waiting for")
    def wait(self, obj: WorkflowRun) -> str:
        if obj.wait_signal:
            return f"signal {obj.wait_signal!r} (step {obj.wait_seq})"
        return "-"

    @admin.display(description="args")
    def args_json(self, obj: WorkflowRun) -> str:
        return base.pretty_json(obj.args)

    @admin.display(description="kwargs")
    def kwargs_json(self, obj: WorkflowRun) -> str:
        return base.pretty_json(obj.kwargs)

    @admin.display(description="result")
    def result_json(self, obj: WorkflowRun) -> str:
        return base.pretty_json(obj.result)

    @admin.display(description="recorded")
    def history(self, obj: WorkflowRun) -> str:
        db = obj._state.db
        steps = WorkflowStep.objects.using(db).filter(run_id=obj.pk).count()
        signals = WorkflowSignal.objects.using(db).filter(run_id=obj.pk).count()
        children = WorkflowRun.objects.using(db).filter(parent_id=obj.pk).count()
        query = "?" + urlencode({"run__id__exact": obj.pk})
        return format_html(
            '<a href="{}">{} steps</a> · <a href="{}">{} signals</a> · '
            '<a href="{}">{} child runs</a> · <a href="{}">wake-up timers</a>',
            reverse("admin:durable_workflowstep_changelist") + query,
            steps,
            reverse("admin:durable_workflowsignal_changelist") + query,
            signals,
            reverse("admin:durable_workflowrun_changelist")
            + "?"
            + urlencode({"parent__id__exact": obj.pk}),
            children,
            reverse("admin:durable_timer_changelist") + "?" + urlencode({"q": f"wf:{obj.pk}:"}),
        )

    @admin.display(description="timeline")
    def timeline(self, obj: WorkflowRun) -> str:
        return timelines.render([obj], with_heading=False)

    # -- actions ------------------------------------------------------------------------

    @admin.action(description="Cancel selected runs (and their child runs)", permissions=["change"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        ids = base.bounded_ids(self, request, queryset)
        if ids is None:
            return
        done, skipped = base.each(ids, durable.cancel_workflow, lambda cancelled: cancelled is True)
        base.report(self, request, done, skipped, "cancelled", "finished")

    @admin.action(description="Retry selected failed runs", permissions=["change"])
    def retry_runs(self, request: HttpRequest, queryset: QuerySet[WorkflowRun]) -> None:
        ids = base.bounded_ids(self, request, queryset)
        if ids is None:
            return
        done, skipped = base.each(ids, operations.retry, lambda run: True)
        base.report(self, request, done, skipped, "retried", "not failed")

    @admin.action(description="Send a signal to selected runs…", permissions=["change"])
    def send_signal(
        self, request: HttpRequest, queryset: QuerySet[WorkflowRun]
    ) -> HttpResponse | None:
        def apply(ids: list[Any], data: dict[str, Any]) -> None:
            def send(pk: str) -> object:
                return durable.send_signal(pk, data["name"], data["payload"])

            done, skipped = base.each(ids, send, lambda signal: True)
            verb = f"sent {data['name']!r} to"
            base.report(self, request, done, skipped, verb, "finished")

        return base.form_action(self, request, queryset, SignalForm, "Send a signal", apply)


class _RunChildAdmin(base.ReadOnlyRows, base.BigTable, admin.ModelAdmin):
    """Steps and signals: read-only lists, usually opened filtered to one run."""

    raw_id_fields = ("run",)

    def get_ordering(self, request: HttpRequest) -> tuple[str, ...]:
        # One run's history in order (its (run, ...) index); otherwise the newest rows.
        return self.run_order if "run__id__exact" in request.GET else ("-id",)

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        return (queryset.filter(run_id=term) if term else queryset), False

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: Any) -> str:
        url = reverse("admin:durable_workflowrun_change", args=[quote(obj.run_id)])
        return format_html('<a href="{}">{}</a>', url, obj.run_id)


@admin.register(WorkflowStep)
class WorkflowStepAdmin(_RunChildAdmin):
    """Recorded steps (the replay history)."""

    run_order = ("seq",)
    list_display = ("id", "run_link", "seq", "kind", "name", "status", "attempts", "updated_at")
    sortable_by = ()
    search_fields = ("run__id",)
    search_help_text = "A run id (exact)."


@admin.register(WorkflowSignal)
class WorkflowSignalAdmin(_RunChildAdmin):
    """Signals sent to runs, consumed or not."""

    run_order = ("-id",)
    list_display = ("id", "run_link", "name", "created_at", "consumed_at", "consumed_seq")
    sortable_by = ()
    search_fields = ("run__id",)
    search_help_text = "A run id (exact)."
