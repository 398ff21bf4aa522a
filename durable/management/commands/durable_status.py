"""``python manage.py durable_status``: shards, workers, lag, fire rate, failures, retention."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.storage import status


def collect(now_ms: int) -> dict[str, Any]:
    """Gather the overview as plain data (the admin's overview reads the same queries,
    with its counts capped: :func:`durable.admin.cluster.overview_data`)."""
    conf = get_settings()
    db = conf.DATABASE
    pending = status.pending_by_shard(db)
    failed_count, failed = status.failed_timers(db, limit=10)
    return {
        "shards": [
            {
                "shard": s.shard,
                "owner": s.owner or None,
                "token": s.token,
                "live": s.live,
                "lag_ms": s.lag_ms,
                "pending": pending.get(s.shard, 0),
            }
            for s in status.shards(db, now_ms)
        ],
        "workers": [
            {
                **n,
                "heartbeat_at": n["heartbeat_at"].isoformat(),
                "started_at": n["started_at"].isoformat(),
            }
            for n in status.nodes(db, now_ms, conf.LEASE_TTL_S)
        ],
        "recent": status.recent_fires(db, now_ms),
        "failed": {
            "count": failed_count,
            "latest": [
                {"id": t.pk, "target": t.target, "attempts": t.attempts, "error": t.last_error}
                for t in failed
            ],
        },
        "retention": [
            {"what": r.what, "setting": r.setting, "days": r.days, "past": r.past, "cap": r.cap}
            for r in status.retention(db, now_ms, conf)
        ],
    }


class Command(BaseCommand):
    help = "Show shard owners, lag, workers, recent fires, failed timers and retention."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")

    def handle(self, *args: Any, **options: Any) -> None:
        data = collect(current_clock().now_ms())
        if options["json"]:
            self.stdout.write(json.dumps(data, indent=2))
            return
        self._text(data)

    def _text(self, data: dict[str, Any]) -> None:
        out = self.stdout.write
        live = [w for w in data["workers"] if w["live"]]
        owned = [s for s in data["shards"] if s["live"]]
        out(f"workers: {len(live)} live / {len(data['workers'])} known")
        for w in data["workers"]:
            state = "live" if w["live"] else "gone"
            beat = w["heartbeat_at"]
            out(f"  {w['name']:<30} {state:<5} shards={w['shards']:<3} heartbeat {beat}")
        out(f"shards: {len(owned)} owned / {len(data['shards'])}")
        out(f"  {'shard':>5} {'owner':<30} {'token':>6} {'lag ms':>8} {'pending':>9}")
        for s in data["shards"]:
            lag = "-" if s["lag_ms"] is None else s["lag_ms"]
            out(
                f"  {s['shard']:>5} {s['owner'] or '(free)':<30} {s['token']:>6} {lag:>8} "
                f"{s['pending']:>9}"
            )
        r = data["recent"]
        lat = r["lateness_ms"]
        out(
            f"last {r['window_s']} s: {r['fired']} fired ({r['per_s']}/s), lateness ms "
            f"p50={lat['p50']} p99={lat['p99']} max={lat['max']}"
        )
        out(f"failed timers (dead letter): {data['failed']['count']}")
        for t in data["failed"]["latest"]:
            out(f"  #{t['id']} {t['target']} attempts={t['attempts']}: {t['error']}")
        parts = [
            f"{r['what']} {_days(r['days'])} ({r['past']}{'+' if r['past'] >= r['cap'] else ''}"
            " past)"
            for r in data["retention"]
        ]
        out("retention: " + ", ".join(parts))


def _days(days: float | None) -> str:
    if days is None:
        return "forever"
    return f"{days:g} d"
