"""Shard leases, worker nodes, and the overview page of the whole cluster.

Leases and nodes are written by workers only, so their admin is view-only. The overview
(``admin:durable_overview``, linked from the app's index) gathers what an operator looks
at first: who owns which shard and how far behind it is, which workers are alive, the
fire rate and lateness of the last minute, and what failed. It reads the queries of
``durable_status`` (:mod:`durable.storage.status`) for shards, workers and fires, but
counts big tables with a cap (:mod:`durable.storage.admin_queries`): the page must stay
fast with millions of pending or failed timers. Each section shows only to users who
may view its model.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Model
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path

from durable.admin import base
from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.timeutil import ms_to_datetime
from durable.models import CronSchedule, ShardLease, Timer, WorkerNode, WorkflowRun
from durable.storage import admin_queries, status

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
        """The cluster overview: shards, workers, fire rate, lateness, failures.

        Open to users who may view shard leases; each other section only to users who
        may view its model (a run's error is no business of a leases-only user).
        """
        if not self.has_view_permission(request):
            raise PermissionDenied
        show = {
            section: self._may_view(request, model) for section, model in SECTION_MODELS.items()
        }
        context = {
            **self.admin_site.each_context(request),
            "title": "Durable overview",
            "opts": self.model._meta,
            "show": show,
            **overview_data(current_clock().now_ms(), {name for name, ok in show.items() if ok}),
        }
        return TemplateResponse(request, "admin/durable/overview.html", context)

    def _may_view(self, request: HttpRequest, model: type[Model]) -> bool:
        # Ask the model's own admin, so the overview agrees with the model's pages
        # (a site that unregisters a model hides its section too).
        if not self.admin_site.is_registered(model):
            return False
        return bool(self.admin_site.get_model_admin(model).has_view_permission(request))


#: The overview's sections beyond the shards, and the model whose view permission each
#: needs.
SECTION_MODELS: dict[str, type[Model]] = {
    "timers": Timer,
    "runs": WorkflowRun,
    "schedules": CronSchedule,
    "workers": WorkerNode,
}


def overview_data(
    now_ms: int, sections: Collection[str] = frozenset(SECTION_MODELS)
) -> dict[str, Any]:
    """What the overview page shows (plain data, ready for the template).

    Only the ``sections`` given are queried (the shards always are). Counts on big
    tables are capped (:mod:`durable.storage.admin_queries`): a figure with ``+``
    means "at least".
    """
    conf = get_settings()
    db = conf.DATABASE
    raft = status.raft_view(db, now_ms, conf.LEASE_TTL_S)
    shards = [
        {
            "shard": s.shard,
            "owner": s.owner or None,
            "token": s.token,
            "live": s.live,
            "lag_ms": s.lag_ms,
            "lag": None if s.lag_ms is None else base.duration(s.lag_ms / 1000),
            "raft": raft.get(s.shard),  # Raft on: leader, term, followers
        }
        for s in status.shards(db, now_ms)
    ]
    data: dict[str, Any] = {
        "now": ms_to_datetime(now_ms),
        "shards": shards,
        "owned": sum(1 for s in shards if s["live"]),
        "max_lag": max((s["lag_ms"] for s in shards if s["lag_ms"] is not None), default=None),
        "raft": bool(raft),
    }
    if "timers" in sections:
        pending = admin_queries.pending_by_shard(db, conf.SHARDS)
        for shard in shards:
            shard["pending"] = pending.counts.get(shard["shard"], 0)
            shard["pending_capped"] = shard["shard"] in pending.capped
        data["pending"] = sum(pending.counts.values())
        data["pending_capped"] = bool(pending.capped)
        data["pending_limit"] = pending.limit
        data["recent"] = status.recent_fires(db, now_ms)
        data["failed_timers"] = admin_queries.failed_timers(db)
    if "workers" in sections:
        workers = status.nodes(db, now_ms, conf.LEASE_TTL_S)
        for worker in workers:
            beat = worker["heartbeat_at"]
            worker["heartbeat"] = base.relative(int(beat.timestamp() * 1000), now_ms)
        data["workers"] = workers
        data["live_workers"] = sum(1 for w in workers if w["live"])
    if "runs" in sections:
        before = ms_to_datetime(now_ms) - STALLED_AFTER
        data["failed_runs"] = admin_queries.failed_runs(db)
        data["stalled_runs"] = admin_queries.stalled_runs(db, before)
        data["stalled_after"] = base.duration(STALLED_AFTER.total_seconds())
    if "schedules" in sections:
        data["failing_schedules"] = admin_queries.failing_schedules(db)
        data["schedules"] = admin_queries.schedule_counts(db)
    return data


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
