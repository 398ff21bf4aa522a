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
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import F, Q

from durable.exceptions import LeaseLost
from durable.models import ShardLease, WorkerNode
from durable.storage import statements


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
    raft_term: int = 0

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
    fields = ("shard", "owner", "token", "expires_at", "cursor_ms", "raft_term")
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
        # raft_term 0: taken by the lease rules, so any Raft leader may take it at once.
        taken = leases.filter(free, shard=shard).update(
            owner=owner,
            token=F("token") + 1,
            expires_at=now + timedelta(seconds=ttl_s),
            raft_term=0,
            updated_at=now,  # as acquire_many's SQL does
        )
        if not taken:
            return None
        token: int = leases.values_list("token", flat=True).get(shard=shard)
    return token


def acquire_as_leader(
    db: str, terms: Mapping[int, int], owner: str, now_ms: int, ttl_s: float
) -> dict[int, int]:
    """Take the shards in ``terms`` (shard → this node's Raft term) as their Raft leader;
    return the new token of each shard taken.

    One conditional UPDATE for all of them: a row is taken when its lease is free or
    expired (as :func:`acquire`) or when it records an older Raft term than ours, so a
    newly elected leader takes the shard at once, without waiting for the old owner's
    lease to run out. The token goes up (the old owner's next fenced statement fails) and
    the term is stored. Rows locked by a firing transaction are skipped (SKIP LOCKED, as
    in :func:`acquire`): taken on a later turn.
    """
    if not terms:
        return {}
    conn = connections[db]
    shards = sorted(terms)
    marks = ", ".join(["%s"] * len(shards))
    term_of = "CASE shard " + "WHEN %s THEN %s " * len(shards) + "END"
    term_params = [v for s in shards for v in (s, terms[s])]
    now = conn.ops.adapt_datetimefield_value(ms_to_dt(now_ms))
    expires = conn.ops.adapt_datetimefield_value(ms_to_dt(now_ms) + timedelta(seconds=ttl_s))
    takeable = (
        f"shard IN ({marks}) AND (owner = '' OR expires_at IS NULL OR expires_at <= %s "
        f"OR raft_term < {term_of})"
    )
    skip = " FOR UPDATE SKIP LOCKED" if conn.features.has_select_for_update_skip_locked else ""
    with transaction.atomic(using=db), conn.cursor() as cursor:
        cursor.execute(
            f"UPDATE durable_shardlease SET owner = %s, token = token + 1, expires_at = %s, "
            f"raft_term = {term_of}, updated_at = %s WHERE shard IN ("
            f"SELECT shard FROM durable_shardlease WHERE {takeable}{skip}) "
            "RETURNING shard, token",
            [owner, expires, *term_params, now, *shards, now, *term_params],
        )
        return {shard: token for shard, token in cursor.fetchall()}


FROZEN_HOLDER_IDLE_S = 0.5
"""How long a session must have sat idle inside its transaction, holding the lease row of
a shard a newer Raft leader takes, before :func:`end_frozen_holders` ends it."""


def end_frozen_holders(db: str, shards: Iterable[int], idle_s: float) -> list[int]:
    """End the sessions that hold ``shards``' lease rows locked while idle in their
    transaction for ``idle_s`` or more; return their server pids (PostgreSQL only).

    A frozen owner (SIGSTOP, a VM pause) keeps its firing transaction open, and with it
    the lock on its shards' lease rows, until PostgreSQL's idle-in-transaction timeout
    (twice ``LEASE_TTL_S``): the new Raft leader's takeover skips locked rows, so the shard
    would wait that long. Only a leader with a newer term calls this, for rows it could
    not take: the holder has lost the shard already and its commit would be fenced, so
    ending its transaction loses nothing (its fires stay pending and run again). A row
    lock's holder is the transaction in the row's ``xmax``; ``pg_locks`` names its pid.
    Ending another session needs the same database role (or ``pg_signal_backend``).
    """
    shards = sorted(set(shards))
    conn = connections[db]
    if not shards or conn.vendor != "postgresql":
        return []
    marks = ", ".join(["%s"] * len(shards))
    try:
        with transaction.atomic(using=db), conn.cursor() as cursor:
            return _terminate_holders(cursor, shards, marks, idle_s)
    except DatabaseError:  # not allowed to end that session (another role): wait for it
        return []


def _terminate_holders(cursor: Any, shards: list[int], marks: str, idle_s: float) -> list[int]:
    """The statement of :func:`end_frozen_holders`: find the holders and end them."""
    cursor.execute(
        "SELECT a.pid, pg_terminate_backend(a.pid) FROM durable_shardlease l "
        "JOIN pg_locks k ON k.locktype = 'transactionid' AND k.granted "
        "AND k.mode = 'ExclusiveLock' AND k.transactionid = l.xmax "
        "JOIN pg_stat_activity a ON a.pid = k.pid "
        f"WHERE l.shard IN ({marks}) AND a.pid <> pg_backend_pid() "
        "AND a.state = 'idle in transaction' AND EXISTS (SELECT 1 FROM pg_locks r "
        "WHERE r.pid = a.pid AND r.relation = 'durable_shardlease'::regclass) "
        "AND a.state_change <= clock_timestamp() - make_interval(secs => %s)",
        [*shards, idle_s],
    )
    return sorted({pid for pid, _ in cursor.fetchall()})


def renew(
    db: str,
    owner: str,
    held: Mapping[int, int],
    cursors: Mapping[int, int],
    now_ms: int,
    ttl_s: float,
) -> set[int]:
    """Extend the leases in ``held`` (shard → token); return the shards still ours.

    One UPDATE for every shard (each row gets its own cursor), then one SELECT of the
    rows that carry our owner and token, in one transaction: a shard not returned was
    taken over. Two statements whatever the number of shards, because the worker renews
    between firing batches, and 64 UPDATEs there were a 40 ms stall in the fire loop.
    """
    if not held:
        return set()
    expires = ms_to_dt(now_ms) + timedelta(seconds=ttl_s)
    conn = connections[db]
    shards = sorted(held)
    marks = ", ".join(["%s"] * len(shards))
    case_of = "CASE shard " + "WHEN %s THEN %s " * len(shards) + "END"

    def per_shard(values: Mapping[int, int]) -> list[int]:
        return [v for shard in shards for v in (shard, values.get(shard, 0))]

    ours = f"shard IN ({marks}) AND owner = %s AND token = {case_of}"
    ours_params = [*shards, owner, *per_shard(held)]
    with transaction.atomic(using=db), conn.cursor() as cursor:
        cursor.execute(
            f"UPDATE durable_shardlease SET expires_at = %s, cursor_ms = {case_of} WHERE {ours}",
            [conn.ops.adapt_datetimefield_value(expires), *per_shard(cursors), *ours_params],
        )
        cursor.execute(f"SELECT shard FROM durable_shardlease WHERE {ours}", ours_params)
        return {shard for (shard,) in cursor.fetchall()}


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
    stale = fence_shards(db, {shard: token})
    if stale:
        current = stale[shard]
        raise LeaseLost(
            f"lease of shard {shard} lost: token {token} is stale (now {current})",
            shard=shard,
            token=token,
            current_token=current,
        )


def fence_shards(db: str, tokens: Mapping[int, int]) -> dict[int, int | None]:
    """:func:`fence` for several shards in one statement; return the stale ones.

    ``tokens`` maps shard → the token we hold. The lease rows are locked in shard order,
    so two transactions fencing overlapping sets never deadlock. The lock is a share
    lock: fencing transactions of the same worker (the fire loop, external completions,
    workflow checkpoints) do not queue behind each other, while an acquire or renewal,
    which updates the row, waits for all of them. The result maps each stale shard to
    the token its row holds now (None when the row is missing); empty means all ours.
    """
    conn = connections[db]
    if not conn.in_atomic_block:
        raise RuntimeError("fence() must run inside transaction.atomic()")
    shards = sorted(tokens)
    lock = " FOR SHARE" if conn.features.has_select_for_update else ""
    where, params = statements.in_clause(conn.vendor, shards, "shard", "integer")
    if conn.vendor == "postgresql":  # often a transaction's first statement
        where += f" AND {statements.IDLE_GUARD} IS NOT NULL"
    with statements.cursor(db) as cursor:
        cursor.execute(
            f"SELECT shard, token FROM durable_shardlease WHERE {where} ORDER BY shard{lock}",
            params,
        )
        found = dict(cursor.fetchall())
    return {s: found.get(s) for s in shards if found.get(s) != tokens[s]}


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


def heartbeat(
    db: str,
    name: str,
    shards: Iterable[int],
    now_ms: int,
    raft: Mapping[int, Mapping[str, object]] | None = None,
) -> None:
    """Record that this worker is alive, which shards it holds and (Raft on) its view
    of each shard's group: role, term, leader (JSON keys are shard numbers as strings)."""
    fields: dict[str, object] = {
        "heartbeat_at": ms_to_dt(now_ms),
        "shards": sorted(shards),
        "stopped_at": None,
    }
    if raft is not None:
        fields["raft"] = {str(shard): dict(view) for shard, view in raft.items()}
    WorkerNode.objects.using(db).filter(name=name).update(**fields)


def mark_stopped(db: str, name: str, now_ms: int) -> None:
    """Record a clean stop, so other workers stop counting this one at once."""
    WorkerNode.objects.using(db).filter(name=name).update(
        stopped_at=ms_to_dt(now_ms), shards=[], raft={}
    )


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
