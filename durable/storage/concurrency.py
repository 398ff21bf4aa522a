"""Concurrency keys: admit a key's timers up to its limit, park the rest, wake them in order.

A handler declared with ``concurrency_key``/``max_concurrency`` stores each timer's key
(``Timer.concurrency_key``) and routes the timer to the key's shard, so one owner, under
its lease token, decides for the key. A key's *active* timers are its rows in state
``firing`` (claimed, their handler running or about to); nothing else is counted, so
the count cannot drift from the rows it describes.

- :func:`admit` runs in the firing batch's fenced transaction. It locks the key's row
  (:class:`~durable.limits.ConcurrencyKey`) before counting, so two transactions never
  decide for one key at once and commits landing out of order cannot admit more than
  the limit. A timer over the limit is *parked*: still pending, due at
  :data:`PARKED_MS` (never, until woken), with ``queued_ms`` its place in line (the
  time it first came due). It holds no wheel entry and is never rescanned: no polling.
  A workflow run's start held back while an ancestor run holds a slot of its key is
  admitted in that slot instead (reentrant: see :func:`_in_ancestors_slot`).
- :func:`release` runs in the transaction that records an active timer's end (fired,
  retried, dead-lettered), or that takes a woken one out of the line (cancelled, moved
  by an operator or by a debounced call): every path that ends or moves a keyed timer.
  It locks the key's row and makes the oldest parked timers due now, as many as there
  are free slots. A woken timer keeps its place (``queued_ms``) and holds its slot
  until it fires: a timer that came due later cannot take it.
- :func:`settle` runs in the batch transaction once the batch knows which admitted
  timers it started: those it left for later (no free thread, time budget spent) keep
  their place and slot, and the rate forgets the start logged for them.

Lock order: timer rows (the batch's, or the completing one), then key rows by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.db import connections

from durable.core.sharding import bucket_of
from durable.models import TimerState
from durable.storage import key_counts, key_rows, statements
from durable.storage.key_counts import PARKED_MS as PARKED_MS
from durable.storage.key_counts import counts as _counts
from durable.storage.notify import notify_timers

_WORKFLOW = key_counts.WORKFLOW_PREFIX
_PENDING = TimerState.PENDING.value
_FIRING = TimerState.FIRING.value

#: A handler's ``(max_concurrency, rate)``: either may be ``None`` (no such limit).
Limits = key_rows.Limits

#: (shard, timer id, fire_at_ms) of a timer made due, for the owner's wheel.
Woken = tuple[int, int, int]


def admit(
    db: str,
    limits: Mapping[int, Limits],
    now_ms: int,
    bucket_shift: int,
    from_line: dict[int, int] | None = None,
    logs: Logs | None = None,
) -> set[int]:
    """Decide admission for a batch's keyed timers; park those over their key's limits.

    ``limits`` maps each due, counted timer of a limited handler to its limits. Returns
    the ids parked (their counted attempt given back); the others may fire. A row firing
    already (a claim re-run after its worker died) holds its slot and was counted by the
    rate when it first started: it is always admitted. Admitted timers that waited in
    line are added to ``from_line``, with their place (``queued_ms``): they stay in it
    until :func:`settle` says whether they started. Call inside the batch's fenced
    transaction.

    ``logs`` given, the rate logs are not written here but kept in it, with the starts
    logged per timer, for :func:`settle` to correct and write in one statement once the
    batch's handlers started: the decision then costs one round trip before they start
    on PostgreSQL (two statements in a pipeline: read the batch's keyed rows and lock
    their keys; count), not four.
    """
    by_key: dict[str, list[tuple[Any, ...]]] = {}
    # Rates alone (a key's limits become its handler's): nothing reads the active count.
    active = any(limit is not None for limit, _ in limits.values())
    rows, locked, counts = key_rows.lock_and_count(db, list(limits), active=active)
    for row in rows:
        by_key.setdefault(row[1], []).append(row)
    if not by_key:  # none of them has a key (scheduled before its handler had one)
        return set()
    policies = {key: limits[group[0][0]] for key, group in by_key.items()}
    keys = key_rows.lock_keys(db, policies, locked)
    if locked is None or any(n not in locked for n in by_key):
        # Elsewhere than PostgreSQL; or a key's row created (and locked) just now, after
        # the count: count (again), under lock. A workflow's key needs no second count:
        # the pipelined one counts its runs, in a snapshot taken once the locks were ours.
        counts = _counts(db, sorted(by_key), list(limits), active=active)
    parked: list[int] = []
    admitted_in_line: dict[int, int] = {}
    woken: list[Woken] = []
    for name in sorted(by_key):
        key, group = keys[name], by_key[name]
        active, reserved, waiting = counts[name]
        free, room = key.free(active, reserved), key.room(now_ms)
        # Firing rows first (they hold a slot), then the line: its place, then id.
        group.sort(key=lambda r: (r[2] != _FIRING, r[3] if r[3] is not None else r[4], r[0]))
        held: list[tuple[Any, ...]] = []
        for row in group:
            timer_id, _, state, queued_ms = row[:4]
            # A timer new to the line goes behind those parked in it already.
            in_turn = queued_ms is not None or not waiting
            if state == _FIRING or (free > 0 and room > 0 and in_turn):
                # A claim re-run holds its slot (the counts left it out, as one of the
                # batch's) but was logged by the rate when it first started.
                free -= 1
                if state != _FIRING:
                    room -= 1
                    key.started(now_ms)
                    if logs is not None and key.rate is not None:
                        logs.started[timer_id] = name
                if queued_ms is not None:
                    admitted_in_line[timer_id] = queued_ms
            else:
                held.append(row)
        inside, deferred = _in_ancestors_slot(db, name, key, held, now_ms, bucket_shift, logs)
        admitted_in_line.update((i, place) for i, place in inside.items() if place is not None)
        parked_here = [row[0] for row in held if row[0] not in inside and row[0] not in deferred]
        _park(db, parked_here, bucket_shift)
        parked += parked_here + list(deferred)
        woken += deferred.values()
        waiting += len(parked_here)
        counted = (free, reserved + len(deferred), waiting)
        woken += _next_in_line(db, name, key, counted, now_ms, bucket_shift)
    if logs is None:
        key_rows.save_logs(db, keys)
    else:
        logs.keys.update(keys)
    if from_line is not None:
        from_line.update(admitted_in_line)
    notify_timers(db, woken)
    return set(parked)


def _in_ancestors_slot(
    db: str,
    name: str,
    key: key_rows.Key,
    held: list[tuple[Any, ...]],
    now_ms: int,
    bucket_shift: int,
    logs: Logs | None,
) -> tuple[dict[int, int | None], dict[int, Woken]]:
    """Of a workflow key's ``held`` start timers (over its limit, or behind its line),
    admit those whose run has an ancestor holding a slot of the key, in that slot.

    Reentrant, as a lock its holder takes again: the ancestor holds the slot to its end,
    and, when it waits for this descendant, would otherwise wait for ever (the slot
    frees only when the ancestor ends). The descendant is counted while it runs, so other
    runs of the key wait for the whole tree. It still obeys the rate: with no room now it
    is made due when the window has room (not parked: nothing would wake it while the
    ancestor holds the slot), keeping its place. Returns the admitted, with their place
    in line (``None``: new to it), and the made due later (their attempt given back).
    """
    if not held or key.limit is None or not name.startswith(_WORKFLOW):
        return {}, {}
    inside = key_counts.in_ancestors_slot(db, name, [row[0] for row in held])
    admitted: dict[int, int | None] = {}
    deferred: dict[int, Woken] = {}
    for timer_id, _, _, queued_ms, _, shard in held:
        if timer_id not in inside:
            continue
        if key.room(now_ms) > 0:
            key.started(now_ms)
            if logs is not None and key.rate is not None:
                logs.started[timer_id] = name
            admitted[timer_id] = queued_ms
        else:
            assert key.rate is not None  # room is infinite without a rate
            due_ms = key.rate.next_ms(key.log)
            _park(db, [timer_id], bucket_shift, due_ms)
            deferred[timer_id] = (shard, timer_id, due_ms)
    return admitted, deferred


class Logs:
    """The rate logs :func:`admit` changed and has not written yet (see its ``logs``)."""

    __slots__ = ("keys", "started")

    def __init__(self) -> None:
        self.keys: dict[str, key_rows.Key] = {}
        """The keys decided for, locked by the transaction, with their logs as changed."""
        self.started: dict[int, str] = {}
        """Timers whose start a rate logged at ``now_ms``, with their key's name."""


def settle(
    db: str, started: list[int], left: list[int], now_ms: int, logs: Logs | None = None
) -> None:
    """After :func:`admit`, once the batch knows which admitted timers it ran.

    ``started``: admitted timers that waited in line and started (or ended): they leave
    it, so a later retry is a new arrival. ``left``: admitted timers the batch left for
    later (no free thread, or its time budget spent): they keep their place in line, or
    take the one their due time gives them, and hold their slot until they start, as a
    woken timer does; the starts :func:`admit` logged for them at ``now_ms`` are taken
    back, so a rate does not count them until they do start. In the batch transaction,
    before anything of the batch calls :func:`release`. With the ``logs`` :func:`admit`
    kept, the correction is made on them (the keys are still locked) and they are written.
    """
    _leave_line(db, started)
    if logs is not None:
        for timer_id in left:
            if timer_id in logs.started:
                _unlog(logs.keys[logs.started[timer_id]], now_ms)
        key_rows.save_logs(db, logs.keys)
    if not left:
        return
    vendor = connections[db].vendor
    where, params = statements.in_clause(vendor, left)
    with statements.cursor(db) as cursor:
        cursor.execute(
            "UPDATE durable_timer SET queued_ms = COALESCE(queued_ms, fire_at_ms) "
            f"WHERE {where} AND state = %s",
            [*params, _PENDING],
        )
    if logs is not None:
        return
    per_key: dict[str, int] = {}
    for row in key_rows.keyed_rows(db, left):
        if row[2] == _PENDING:  # a claim re-run (firing) logged no start here
            per_key[row[1]] = per_key.get(row[1], 0) + 1
    keys = key_rows.lock_keys(db, {name: None for name in per_key})
    for name, key in keys.items():
        for _ in range(per_key[name] if key.rate is not None else 0):
            _unlog(key, now_ms)
    key_rows.save_logs(db, keys)


def _unlog(key: key_rows.Key, now_ms: int) -> None:
    """Take back one start logged at ``now_ms``: admit's, for a timer left for later."""
    if now_ms in key.log:  # the last one logged at now_ms
        del key.log[len(key.log) - 1 - key.log[::-1].index(now_ms)]
        key.logged = True


def release(db: str, timer_ids: Iterable[int], now_ms: int, bucket_shift: int) -> list[Woken]:
    """Wake the oldest parked timers of the keys of ``timer_ids``, which just ended.

    Call in the transaction that records their end (or their cancel). Returns the
    timers made due (also announced by NOTIFY at commit).
    """
    ids = list(timer_ids)
    rows, locked, counts = key_rows.lock_and_count(db, ids, ended=True)
    names = sorted({row[1] for row in rows})
    if locked is None:
        return release_keys(db, names, now_ms, bucket_shift)
    # A key without a row yet: no batch ever decided for it, so nobody waits in its line.
    keys = key_rows.lock_keys(db, dict.fromkeys(names), locked)
    return _wake_next(db, keys, counts, now_ms, bucket_shift)


def release_keys(db: str, names: Iterable[str], now_ms: int, bucket_shift: int) -> list[Woken]:
    """:func:`release` by key name: for a timer whose row is gone (a debounced timer
    moved to a new row) or whose key the caller knows already."""
    names = sorted(set(names))
    if not names:
        return []
    keys = key_rows.lock_keys(db, {name: None for name in names})
    if not keys:  # no batch ever decided for them: nobody waits in their line
        return []
    return _wake_next(db, keys, _counts(db, sorted(keys), []), now_ms, bucket_shift)


def _wake_next(
    db: str,
    keys: Mapping[str, key_rows.Key],
    counts: Mapping[str, tuple[int, int, int]],
    now_ms: int,
    bucket_shift: int,
) -> list[Woken]:
    """:func:`_next_in_line` of each locked key, by name, with its ``counts``; announced."""
    woken: list[Woken] = []
    for name, key in sorted(keys.items()):
        active, reserved, waiting = counts[name]
        free = (key.free(active, reserved), reserved, waiting)
        woken += _next_in_line(db, name, key, free, now_ms, bucket_shift)
    notify_timers(db, woken)
    return woken


def _next_in_line(
    db: str,
    name: str,
    key: key_rows.Key,
    counts: tuple[float, int, int],
    now_ms: int,
    bucket_shift: int,
) -> list[Woken]:
    """Make due the parked timers of ``name`` whose turn it is, oldest first; return them.

    ``counts``: the key's free slots, woken timers not started yet, and parked ones.
    As many as there are free slots; with a rate, no more than it allows now, or (none
    allowed now) the first one alone, due when the window has room, and none while a
    woken one has not started yet (it will call the next when it does).
    """
    free, reserved, waiting = counts
    if waiting <= 0 or free <= 0:
        return []
    if key.rate is None:
        return _wake(db, name, int(free), now_ms, bucket_shift)
    if reserved:
        return []
    room = key.room(now_ms)
    if room > 0:
        return _wake(db, name, int(min(free, room)), now_ms, bucket_shift)
    return _wake(db, name, 1, key.rate.next_ms(key.log), bucket_shift)


def _wake(db: str, key: str, count: int, due_ms: int, bucket_shift: int) -> list[Woken]:
    """Make the ``count`` oldest parked timers of ``key`` due at ``due_ms``; return them."""
    with statements.cursor(db) as cursor:
        cursor.execute(
            "SELECT id, shard FROM durable_timer WHERE concurrency_key = %s AND state = %s "
            "AND queued_ms IS NOT NULL AND fire_at_ms = %s ORDER BY queued_ms, id LIMIT %s",
            [key, _PENDING, PARKED_MS, count],
        )
        rows = cursor.fetchall()
    if not rows:
        return []
    where, params = statements.in_clause(connections[db].vendor, [row[0] for row in rows])
    with statements.cursor(db) as cursor:
        cursor.execute(
            f"UPDATE durable_timer SET fire_at_ms = %s, bucket = %s WHERE {where}",
            [due_ms, bucket_of(due_ms, bucket_shift), *params],
        )
    return [(shard, timer_id, due_ms) for timer_id, shard in rows]


def _park(db: str, ids: list[int], bucket_shift: int, due_ms: int = PARKED_MS) -> None:
    """Park ``ids`` (see the module docstring) and give back the attempt counted for them.

    ``due_ms`` given: due then instead (in line, holding a slot, as a woken timer)."""
    if not ids:
        return
    where, params = statements.in_clause(connections[db].vendor, ids)
    with statements.cursor(db) as cursor:
        cursor.execute(
            "UPDATE durable_timer SET queued_ms = COALESCE(queued_ms, fire_at_ms), "
            "fire_at_ms = %s, bucket = %s, attempts = attempts - 1, claim_token = NULL "
            f"WHERE {where} AND state = %s",
            [due_ms, bucket_of(due_ms, bucket_shift), *params, _PENDING],
        )


def _leave_line(db: str, ids: list[int]) -> None:
    """Admitted timers that waited in line leave it (a later retry is a new arrival)."""
    if not ids:
        return
    where, params = statements.in_clause(connections[db].vendor, ids)
    with statements.cursor(db) as cursor:
        cursor.execute(f"UPDATE durable_timer SET queued_ms = NULL WHERE {where}", params)
