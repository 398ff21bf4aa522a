"""Timelines in admin pages: a run's own page, and the page of the row a run is bound to.

A run's page shows its timeline (:mod:`durable.admin.timeline` draws it). For the rows
of your own models that workflows are bound to (``@durable.workflow`` on a model method,
``runs().for_object(obj)``), add :class:`RunTimelineMixin` to their ``ModelAdmin``: the
change page then shows the timelines of the latest runs bound to the row, to users who
may view workflow runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.db.models import Model
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import NoReverseMatch, reverse
from django.utils.safestring import SafeString

from durable.admin import timeline
from durable.core.clock import current_clock
from durable.models import WorkflowRun
from durable.storage import run_times

#: The readonly field :class:`RunTimelineMixin` adds to the change page.
FIELD = "durable_timelines"


def draw(run: WorkflowRun) -> timeline.Timeline:
    """Read ``run``'s recorded times and lay out its timeline (as of the injected clock)."""
    db = run._state.db or "default"
    steps = run_times.step_times(db, run.pk)
    signals = run_times.signal_times(db, run.pk, timeline.MAX_SIGNAL_ROWS)
    return timeline.build(run, steps, signals, current_clock().now_ms())


def render(runs: list[WorkflowRun], *, with_heading: bool, more: str = "") -> SafeString:
    """The HTML of the runs' timelines (escaped by the template engine); with a heading
    each, linked to the run's page, when ``with_heading``."""
    drawn = [draw(run) for run in runs]
    if with_heading:
        drawn = [replace(timeline, link=_run_page(timeline.run)) for timeline in drawn]
    html = render_to_string(
        "admin/durable/timeline.html",
        {"timelines": drawn, "with_heading": with_heading, "more": more},
    )
    return SafeString(html)


def _run_page(run: WorkflowRun) -> str:
    """The run's admin page; "" where durable's admin is not installed under ``admin:``
    (a custom admin site: the heading is then not a link)."""
    try:
        return reverse("admin:durable_workflowrun_change", args=[quote(run.pk)])
    except NoReverseMatch:
        return ""


def may_view_runs(request: HttpRequest) -> bool:
    """Whether the user may see workflow runs (view or change permission, as the
    run pages ask)."""
    user = request.user
    return bool(
        user.is_active
        and user.is_staff
        and (
            user.has_perm("durable.view_workflowrun") or user.has_perm("durable.change_workflowrun")
        )
    )


class RunTimelineMixin:
    """A ``ModelAdmin`` mixin: the change page shows the timelines of the latest
    :attr:`timeline_runs` workflow runs bound to the row (``runs().for_object(obj)``).

    ::

        @admin.register(Order)
        class OrderAdmin(RunTimelineMixin, admin.ModelAdmin):
            timeline_runs = 3

    The timelines are a fieldset of their own, last, shown only to users with the
    *view workflow run* (or *change*) permission, and only on an existing row's page.
    """

    #: How many of the row's runs are drawn, newest first.
    timeline_runs = 5

    def _shows_timelines(self, request: HttpRequest, obj: Model | None) -> bool:
        return obj is not None and obj.pk is not None and may_view_runs(request)

    def get_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        # Without declared fields Django lists the readonly ones too; ours has its own
        # fieldset (below), so it must not appear twice.
        fields = super().get_fields(request, obj)  # type: ignore[misc]
        return [name for name in fields if name != FIELD]

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        fields = list(super().get_readonly_fields(request, obj))  # type: ignore[misc]
        return [*fields, FIELD] if self._shows_timelines(request, obj) else fields

    def get_fieldsets(self, request: HttpRequest, obj: Model | None = None) -> Any:
        fieldsets = list(super().get_fieldsets(request, obj))  # type: ignore[misc]
        if self._shows_timelines(request, obj):
            fieldsets.append(("Workflow runs", {"fields": [FIELD], "classes": ["durable-runs"]}))
        return fieldsets

    @admin.display(description="timelines")
    def durable_timelines(self, obj: Model) -> SafeString:
        """The timelines of the runs bound to ``obj`` (the latest :attr:`timeline_runs`)."""
        runs, total = run_times.runs_bound_to(obj, self.timeline_runs)
        if not runs:
            return SafeString("No workflow runs are bound to this row.")
        more = f"The latest {len(runs)} of {total:,} runs are drawn." if total > len(runs) else ""
        return render(runs, with_heading=True, more=more)
