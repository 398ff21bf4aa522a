"""Shard leases and worker nodes: every query of the ownership protocol.

A lease is taken and renewed with one conditional UPDATE each, so two workers racing for
a shard cannot both win; the token goes up by one at every change of owner and is the
fencing token that every firing transaction checks under a row lock (:func:`fence`).
Times are datetimes computed from the worker's database-corrected clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connections, transaction
from django.db.models import F, Q

from durable.exceptions import LeaseLost
from durable.models import ShardLease, WorkerNode


def ms_to_dt(ms: int) -> datetime:
    """Epoch milliseconds → aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


@dataclass(frozen=True, slots=True)
class LeaseRow:
    """A snapshot of one lease row."""

    shard: int
    owner: str
    token: int
    expires_at: datetime | None
    cursor_ms: int

    def is_free(self, now: datetime) -> bool:
        """True when nobody holds it: no owner, or the owner let it expire."""
        return not self.owner or self.expires_at is None or self.expires_at <= now


def ensure_shards(db: str, shards: int) -> None:
    """Create the lease rows for shards ``0..shards-1`` that do not exist yet."""
    ShardLease.objects.using(db).bulk_create(
        [ShardLease(shard=s) for s in range(shards)], ignore_conflicts=True
    )


def snapshot(db: str) -> list[LeaseRow]:
    """Return every lease row, by shard."""
    rows = ShardLease.objects.using(db).order_by("shard")
    fields = ("shard", "owner", "token", "expires_at", "cursor_ms")
    return [LeaseRow(*values) for values in rows.values_list(*fields)]


def acquire(db: str, shard: int, owner: str, now_ms: int, ttl_s: float) -> int | None:
    """Take ``shard`` if it is free or expired; return the new fencing token, or None.

    The row is locked with SKIP LOCKED first: a lease row locked by someone's firing
    transaction (see :func:`fence`) is busy, not free, and waiting on it would stall this
    worker's whole loop behind a possibly frozen peer. The UPDATE re-checks the condition.
    """
    now = ms_to_dt(now_ms)
    free = Q(owner="") | Q(expires_at__isnull=True) | Q(expires_at__lte=now)
    leases = ShardLease.objects.using(db)
    with transaction.atomic(using=db):
        candidate = leases.select_for_update(skip_locked=True).filter(free, shard=shard)
        if not candidate.exists():
            return None
        taken = leases.filter(free, shard=shard).update(
            owner=owner, token=F("token") + 1, expires_at=now + timedelta(seconds=ttl_s)
        )
        if not taken:
            return None
        token: int = leases.values_list("token", flat=True).get(shard=shard)
    return token


def renew(
    db: str,
    owner: str,
    held: Mapping[int, int],
    cursors: Mapping[int, int],
    now_ms: int,
    ttl_s: float,
) -> set[int]:
    """Extend the leases in ``held`` (shard → token); return the shards still ours.

    One UPDATE per shard (each with its own cursor), in one transaction; a shard whose
    row no longer carries our owner and token was taken over and is not returned.
    """
    expires = ms_to_dt(now_ms) + timedelta(seconds=ttl_s)
    kept: set[int] = set()
    with transaction.atomic(using=db):
        for shard, token in held.items():
            updated = (
                ShardLease.objects.using(db)
                .filter(shard=shard, owner=owner, token=token)
                .update(expires_at=expires, cursor_ms=cursors.get(shard, 0))
            )
            if updated:
                kept.add(shard)
    return kept


def release(db: str, shard: int, owner: str, token: int, cursor_ms: int) -> bool:
    """Give ``shard`` up so another worker can take it at once; True if it was ours."""
    updated = (
        ShardLease.objects.using(db)
        .filter(shard=shard, owner=owner, token=token)
        .update(owner="", expires_at=None, cursor_ms=cursor_ms)
    )
    return bool(updated)


def fence(db: str, shard: int, token: int) -> None:
    """Lock the shard's lease row for this transaction and check our token.

    Called first in every transaction that fires or completes a timer. The row lock
    makes a competing acquire wait until this transaction ends, so a fire either
    commits under a valid token or not at all. Raises :class:`LeaseLost`.
    """
    conn = connections[db]
    if not conn.in_atomic_block:
        raise RuntimeError("fence() must run inside transaction.atomic()")
    lock = " FOR UPDATE" if conn.features.has_select_for_update else ""
    with conn.cursor() as cursor:
        cursor.execute(f"SELECT token FROM durable_shardlease WHERE shard = %s{lock}", [shard])
        row = cursor.fetchone()
    if row is None or row[0] != token:
        current = None if row is None else row[0]
        raise LeaseLost(
            f"lease of shard {shard} lost: token {token} is stale (now {current})",
            shard=shard,
            token=token,
            current_token=current,
        )


# --- worker nodes -------------------------------------------------------------------


def register_node(db: str, name: str, host: str, pid: int, now_ms: int) -> None:
    """Create or refresh this worker's ``WorkerNode`` row at start-up."""
    now = ms_to_dt(now_ms)
    WorkerNode.objects.using(db).update_or_create(
        name=name,
        defaults={
            "host": host,
            "pid": pid,
            "started_at": now,
            "heartbeat_at": now,
            "stopped_at": None,
            "shards": [],
        },
    )


def heartbeat(db: str, name: str, shards: Iterable[int], now_ms: int) -> None:
    """Record that this worker is alive and which shards it holds."""
    WorkerNode.objects.using(db).filter(name=name).update(
        heartbeat_at=ms_to_dt(now_ms), shards=sorted(shards), stopped_at=None
    )


def mark_stopped(db: str, name: str, now_ms: int) -> None:
    """Record a clean stop, so other workers stop counting this one at once."""
    WorkerNode.objects.using(db).filter(name=name).update(stopped_at=ms_to_dt(now_ms), shards=[])


def live_node_names(db: str, now_ms: int, ttl_s: float) -> set[str]:
    """Names of workers that heart-beat within ``ttl_s`` and have not stopped."""
    since = ms_to_dt(now_ms) - timedelta(seconds=ttl_s)
    rows = WorkerNode.objects.using(db).filter(heartbeat_at__gte=since, stopped_at__isnull=True)
    return set(rows.values_list("name", flat=True))


def database_now_ms(db: str) -> int | None:
    """The database server's clock in epoch ms (PostgreSQL), or None when it has none."""
    conn = connections[db]
    if conn.vendor != "postgresql":
        return None
    with conn.cursor() as cursor:
        # floor, not the rounding of a plain ::bigint cast: never report a time not yet reached
        cursor.execute("SELECT floor(extract(epoch from clock_timestamp()) * 1000)::bigint")
        (value,) = cursor.fetchone()
    return int(value)
