"""``python manage.py durable_status``: shards, workers, lag, fire rate, failures, retention."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

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
    raft = status.raft_view(db, now_ms, conf.LEASE_TTL_S)
    return {
        "shards": [
            {
                "shard": s.shard,
                "owner": s.owner or None,
                "token": s.token,
                "live": s.live,
                "lag_ms": s.lag_ms,
                "pending": pending.get(s.shard, 0),
                # Raft on: the group's leader, term and followers (None when off)
                "raft": raft.get(s.shard),
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


#: Exit status of ``--check``: healthy, unhealthy (problems listed), database unreachable.
HEALTHY, UNHEALTHY, UNREACHABLE = 0, 1, 2


def health(data: dict[str, Any], max_lag_s: float) -> list[str]:
    """What is wrong with the cluster ``data`` (from :func:`collect`); empty when healthy:
    a live worker, every shard owned by a live lease, none more than ``max_lag_s`` behind."""
    problems = []
    if not any(w["live"] for w in data["workers"]):
        problems.append("no live worker")
    unowned = [s["shard"] for s in data["shards"] if not s["live"]]
    if unowned:
        problems.append(f"{len(unowned)} shard(s) without a live owner: {_ranges(unowned)}")
    lagging = [s["shard"] for s in data["shards"] if (s["lag_ms"] or 0) > max_lag_s * 1000]
    if lagging:
        problems.append(
            f"{len(lagging)} shard(s) more than {max_lag_s:g} s behind: {_ranges(lagging)}"
        )
    return problems


class Command(BaseCommand):
    help = "Show shard owners, lag, workers, recent fires, failed timers and retention."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--json", action="store_true", help="print JSON instead of text")
        parser.add_argument(
            "--check",
            action="store_true",
            help="health check: exit 0 healthy, 1 unhealthy (problems on stderr), "
            "2 database unreachable",
        )
        parser.add_argument(
            "--max-lag-s",
            type=float,
            default=None,
            help="with --check: a shard further behind is unhealthy (default 3 x LEASE_TTL_S)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            data = collect(current_clock().now_ms())
        except DatabaseError as exc:
            if not options["check"]:
                raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommandError(f"database unreachable: {first}", returncode=UNREACHABLE) from None
        max_lag_s = options["max_lag_s"]
        if max_lag_s is None:
            max_lag_s = 3 * get_settings().LEASE_TTL_S
        problems = health(data, max_lag_s)
        if options["json"]:
            data["health"] = {"ok": not problems, "problems": problems, "max_lag_s": max_lag_s}
            self.stdout.write(json.dumps(data, indent=2))
        else:
            self._text(data)
            self.stdout.write("health: " + ("ok" if not problems else "; ".join(problems)))
        if options["check"] and problems:
            raise CommandError("unhealthy: " + "; ".join(problems), returncode=UNHEALTHY)

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
        raft = any(s["raft"] for s in data["shards"])
        head = f"  {'shard':>5} {'owner':<30} {'token':>6} {'lag ms':>8} {'pending':>9}"
        out(head + ("  raft leader (term) / followers" if raft else ""))
        for s in data["shards"]:
            lag = "-" if s["lag_ms"] is None else s["lag_ms"]
            group = s["raft"]
            extra = ""
            if group:
                extra = f"  {group['leader'] or '(none)'} ({group['term']}) / "
                extra += ",".join(group["followers"]) or "-"
            out(
                f"  {s['shard']:>5} {s['owner'] or '(free)':<30} {s['token']:>6} {lag:>8} "
                f"{s['pending']:>9}{extra}"
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


def _ranges(shards: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for shard in sorted(shards):
        if spans and shard == spans[-1][1] + 1:
            spans[-1][1] = shard
        else:
            spans.append([shard, shard])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _days(days: float | None) -> str:
    if days is None:
        return "forever"
    return f"{days:g} d"
