"""Shard leases, worker nodes, and the overview page of the whole cluster.

Leases and nodes are written by workers only, so their admin is view-only. The overview
(``admin:durable_overview``, linked from the app's index) gathers what an operator looks
at first: who owns which shard and how far behind it is, which workers are alive, the
fire rate and lateness of the last minute, and what failed. Its data comes from
``durable_status``'s :func:`~durable.management.commands.durable_status.collect`, so
the page and the command never disagree.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from durable.admin import base
from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.timeutil import ms_to_datetime
from durable.management.commands.durable_status import collect
from durable.models import ShardLease, WorkerNode
from durable.storage import admin_queries

#: A running workflow run whose row has not changed for this long is listed as stalled.
STALLED_AFTER = timedelta(minutes=10)


class _ViewOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(ShardLease)
class ShardLeaseAdmin(_ViewOnly):
    """Who holds each shard; also hosts the overview page's URL."""

    list_display = ("shard", "owner", "token", "live", "expires_at", "cursor", "lag")
    search_fields = ("owner",)
    ordering = ("shard",)
    list_per_page = 256
    change_list_template = "admin/durable/shardlease/change_list.html"

    @admin.display(boolean=True, description="live")
    def live(self, obj: ShardLease) -> bool:
        now = ms_to_datetime(current_clock().now_ms())
        return bool(obj.owner) and obj.expires_at is not None and obj.expires_at > now

    @admin.display(description="cursor")
    def cursor(self, obj: ShardLease) -> str:
        return base.ms_display(obj.cursor_ms or None)

    @admin.display(description="lag (now - cursor)")
    def lag(self, obj: ShardLease) -> str:
        if not obj.cursor_ms or not self.live(obj):
            return "-"
        return base.duration(max(0, current_clock().now_ms() - obj.cursor_ms) / 1000)

    def get_urls(self) -> list[URLPattern]:
        overview = path(
            "overview/", self.admin_site.admin_view(self.overview_view), name="durable_overview"
        )
        return [overview, *super().get_urls()]

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        """The cluster overview: shards, workers, fire rate, lateness, failures."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": "Durable overview",
            "opts": self.model._meta,
            **overview_data(current_clock().now_ms()),
        }
        return TemplateResponse(request, "admin/durable/overview.html", context)


def overview_data(now_ms: int) -> dict[str, Any]:
    """What the overview page shows (plain data, ready for the template)."""
    db = get_settings().DATABASE
    data = collect(now_ms)
    shards = data["shards"]
    for shard in shards:
        shard["lag"] = None if shard["lag_ms"] is None else base.duration(shard["lag_ms"] / 1000)
    workers = data["workers"]
    for worker in workers:
        beat = datetime.fromisoformat(worker["heartbeat_at"])
        worker["heartbeat"] = base.relative(int(beat.timestamp() * 1000), now_ms)
    before = ms_to_datetime(now_ms) - STALLED_AFTER
    return {
        "now": ms_to_datetime(now_ms),
        "shards": shards,
        "owned": sum(1 for s in shards if s["live"]),
        "pending": sum(s["pending"] for s in shards),
        "max_lag": max((s["lag_ms"] for s in shards if s["lag_ms"] is not None), default=None),
        "workers": workers,
        "live_workers": sum(1 for w in workers if w["live"]),
        "recent": data["recent"],
        "failed_timers": data["failed"],
        "failed_runs": admin_queries.failed_runs(db),
        "stalled_runs": admin_queries.stalled_runs(db, before),
        "stalled_after": base.duration(STALLED_AFTER.total_seconds()),
        "failing_schedules": admin_queries.failing_schedules(db),
        "schedules": admin_queries.schedule_counts(db),
    }


@admin.register(WorkerNode)
class WorkerNodeAdmin(_ViewOnly):
    """Worker processes, most recent heartbeat first."""

    list_display = ("name", "host", "pid", "live", "shard_count", "heartbeat_at", "started_at")
    search_fields = ("name", "host")
    ordering = ("-heartbeat_at",)

    @admin.display(boolean=True, description="live")
    def live(self, obj: WorkerNode) -> bool:
        now = ms_to_datetime(current_clock().now_ms())
        ttl = timedelta(seconds=get_settings().LEASE_TTL_S)
        return obj.stopped_at is None and obj.heartbeat_at >= now - ttl

    @admin.display(description="shards")
    def shard_count(self, obj: WorkerNode) -> int:
        return len(obj.shards or [])
