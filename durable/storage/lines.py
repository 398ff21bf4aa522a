"""The line keeper's queries: which keys have a line, and waking their heads by policy.

A parked timer (:mod:`durable.storage.concurrency`) is woken only by the transaction that
ends a running attempt or run of its key. A line can therefore be stranded: its limit
removed or raised by a deploy with nothing of the key running, or a slot freed by a path
that wakes nobody (a row deleted by hand). The worker's line keeper
(:mod:`durable.worker.lines`) calls :func:`parked_keys` now and then and, for the keys of
the shards it owns, :func:`keep` with the limits the code declares *now*.

:func:`keep` only makes timers due, in line order, as many as the key's current limits
leave free: the firing batch's admission still decides whether each starts, and parks
again (in its place: ``queued_ms`` is kept) one that finds the key full.
"""

from __future__ import annotations

from collections.abc import Mapping

from django.db import transaction

from durable.storage import concurrency, key_rows, leases, statements
from durable.storage.key_counts import PARKED_MS
from durable.storage.key_counts import counts as _counts
from durable.storage.notify import notify_timers

#: No limit: what the keeper is given for a key whose code declares none now.
UNLIMITED: concurrency.Limits = (None, None)
#: Most timers of one unlimited key made due per transaction (:func:`keep` repeats).
UNLIMITED_CHUNK = 1_000

_LINE = "state = 'pending' AND queued_ms IS NOT NULL AND fire_at_ms = %s"

_PROBE = (
    f"SELECT concurrency_key FROM durable_timer WHERE {_LINE} AND concurrency_key > %s "
    "ORDER BY concurrency_key, fire_at_ms LIMIT 1"
)
#: Every key with a parked timer, by a skip scan (see :func:`parked_keys`).
PARKED_KEYS_SQL = (
    "WITH RECURSIVE k(name) AS ("
    f"SELECT ({_PROBE.replace(' AND concurrency_key > %s', '')}) "
    f"UNION ALL SELECT ({_PROBE.replace('> %s', '> k.name')}) FROM k "
    "WHERE k.name IS NOT NULL) "
    "SELECT k.name, t.shard, t.kind, t.target, r.name FROM k "
    "JOIN durable_timer t ON t.id = ("
    f"SELECT id FROM durable_timer WHERE concurrency_key = k.name AND {_LINE} LIMIT 1) "
    "LEFT JOIN durable_workflowrun r ON t.kind = 'workflow' AND r.id = t.target "
    "WHERE k.name IS NOT NULL ORDER BY k.name"
)


def parked_keys(db: str) -> list[tuple[str, int, str, str, str | None]]:
    """Every key with a parked timer: ``(key, shard, kind, target, workflow name)`` of its
    first parked row (the workflow's name for a run's start timer, else ``None``).

    A skip scan of ``durable_timer_line_idx``: one index probe per key, whatever the
    length of the lines (a recursive query, the next key after the last one found).
    """
    with statements.cursor(db) as cursor:
        cursor.execute(PARKED_KEYS_SQL, [PARKED_MS, PARKED_MS, PARKED_MS])
        return [tuple(row) for row in cursor.fetchall()]  # type: ignore[misc]


def keep(
    db: str,
    shard: int,
    token: int,
    limits: Mapping[str, concurrency.Limits],
    now_ms: int,
    bucket_shift: int,
) -> list[concurrency.Woken]:
    """Wake the heads of the lines of ``limits``' keys (all of ``shard``), by those limits.

    ``limits`` maps each key to the limits its handler or workflow declares now;
    ``(None, None)`` is no limit: the whole line is made due (in transactions of
    :data:`UNLIMITED_CHUNK` per key). A limited key gets as many as its free slots (and,
    with a rate, what :func:`durable.storage.concurrency.release` would give: those the
    window has room for, or the head alone, due when it has). The key's row takes the
    new limits, so the ends that follow wake by them too (an unlimited key's row keeps
    its old ones: its admissions no longer read it). Each transaction is fenced by
    ``token`` (:class:`~durable.storage.leases.LeaseLost` if the shard was lost).
    Returns the timers made due.
    """
    woken: list[concurrency.Woken] = []
    pending = dict(limits)
    while pending:
        full: dict[str, concurrency.Limits] = {}
        with transaction.atomic(using=db):
            leases.fence(db, shard, token)
            # A limited key's row takes its limits now; an unlimited one's keeps what it
            # has (the row is still locked: an admission of the key waits for this).
            policies = {
                name: None if pending[name] == UNLIMITED else pending[name] for name in pending
            }
            keys = key_rows.lock_keys(db, policies)
            limited = sorted(name for name in keys if policies[name] is not None)
            found = _counts(db, limited, []) if limited else {}
            now_woken: list[concurrency.Woken] = []
            for name in sorted(pending):
                if policies[name] is None:
                    got = concurrency._wake(db, name, UNLIMITED_CHUNK, now_ms, bucket_shift)
                    if len(got) == UNLIMITED_CHUNK:
                        full[name] = pending[name]
                elif name in keys:
                    key = keys[name]
                    active, reserved, waiting = found[name]
                    state = (key.free(active, reserved), reserved, waiting)
                    got = concurrency._next_in_line(db, name, key, state, now_ms, bucket_shift)
                else:  # pragma: no cover - a limited policy's row is created by the lock
                    got = []
                now_woken += got
            notify_timers(db, now_woken)
        woken += now_woken
        pending = full
    return woken
