"""Lateness: how late the worker may fire after each kind of fault (the documented bounds).

Pure, like :mod:`chaos.checker`, which uses it; :func:`check_lateness` is its
``lateness_within_bound`` invariant.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the checker imports this module
    from chaos.checker import History, Verdict

#: A worker's log line for an attempt that ran to its timeout (durable.worker.outcomes).
TIMED_OUT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ \S+ timer\.error timer=(\d+) "
    r"target=(\S+) attempt=(\d+) error=HandlerTimeout: .*? timeout of ([\d.]+) s"
)


#: A worker's log line for an external attempt abandoned past its timeout
#: (durable.worker.external.ExternalRunner.reap); logged when the loop abandoned it.
ABANDONED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ \S+ timer\.timeout timer=(\d+) "
    r"target=(\S+) attempt=(\d+) timeout_s=([\d.]+)"
)

#: A worker's log line for an attempt that failed (any error): the timer is retried later.
FAILED = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ \S+ timer\.error timer=(\d+) "
    r"\S+ attempt=(\d+) "
)
#: durable's default retry policy (BACKOFF_BASE_S): the chaos handlers that can fail on a
#: fault use it, or a faster one (the flaky handler's), so this is the longest wait.
BACKOFF_BASE_MS = 1000

#: A hold begins a little before its handler's timeout starts (the batch's earlier work).
HOLD_SLACK_MS = 500


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    """The documented times the checker holds the worker to (durable's defaults)."""

    lease_ttl_s: float = 10.0
    rescan_s: float = 2.0
    batch_budget_s: float = 2.0
    atomic_timeout_s: float = 5.0
    handler_threads: int = 4

    @property
    def healthy_ms(self) -> int:
        """Lateness allowed with no fault near: two rescans and a batch budget, plus 1 s."""
        return int((2 * self.rescan_s + self.batch_budget_s + 1) * 1000)

    def after(self, fault: dict[str, Any]) -> int:
        """When the worker must have recovered from ``fault``, counted from its start."""
        kind = fault["kind"]
        ttl = self.lease_ttl_s * 1000
        span = fault.get("end_ms", fault["start_ms"]) - fault["start_ms"]
        if kind in ("kill", "crash"):  # docs/how-to/run-the-worker.md: LEASE_TTL_S + 2 s
            return int(ttl + 2000)
        if kind == "stop":
            # Resumed, or taken over once its leases expired; but a worker frozen inside
            # its loop's transaction keeps its lease row locked (others skip it) until
            # PostgreSQL aborts that transaction, after twice LEASE_TTL_S
            # (durable.worker.housekeeping.guard_session).
            return int(min(span, 2 * ttl) + 2000)
        if kind in ("terminate", "listen"):  # reconnect, then the rescan finds what is due
            return int(2 * self.rescan_s * 1000 + 1000)
        if kind in ("lock", "pg_restart"):  # whatever it blocked, then a reconnect and rescan
            return int(span + 5000 + 2 * self.rescan_s * 1000)
        if kind in ("partition", "delay"):
            # Raft links cut or slowed (chaos.raft): a leader the others no longer hear is
            # replaced by a new one, which takes its shards at once; at worst a group with
            # no quorum falls back to the lease rules, whose bound is a kill's.
            return int(span + ttl + 2000)
        if kind == "poison_hang":  # it held its worker's loop from start to end
            return int(span + 2000)
        if kind == "threads_held":
            # Every handler thread held by a hanging external handler: the worker parks
            # its due external timers until one is abandoned (docs/how-to/run-the-worker.md),
            # then runs them in that turn; the loop sleeps at most 1 s on a full pool.
            return int(span + 2000)
        return self.healthy_ms


def explain(
    due: int, fired: int, faults: list[dict[str, Any]], bounds: Bounds, *, chain: bool = True
) -> tuple[int, list[dict[str, Any]]]:
    """When a fire due at ``due`` may come at the latest, and the faults that explain it.

    A fault's recovery is due :meth:`Bounds.after` its start (for one that lasts, a
    freeze or a held lock, that is a fixed time after its end). It explains a late fire
    if its recovery was not over at the due time and it began while the fire could
    still be waiting within its bounds: before its due time plus the healthy lateness,
    or during the recovery from a fault that already explains it (a fault that strikes
    while the worker recovers from another starts the recovery over, so the bound
    counts from the end of the last one). The fire may come as late as the latest
    recovery of the faults that explain it. ``chain=False``: only faults that began
    before the due time plus the healthy lateness count.
    """
    allowed = due + bounds.healthy_ms
    cover: list[dict[str, Any]] = []
    left = sorted(faults, key=lambda f: f["start_ms"])
    grew = True
    while grew:
        grew = False
        for fault in list(left):
            start = fault["start_ms"]
            if start > min(fired, allowed if chain else due + bounds.healthy_ms):
                break  # sorted by start: none of the rest began in time (yet)
            if due <= start + bounds.after(fault):
                cover.append(fault)
                left.remove(fault)
                allowed = max(allowed, start + bounds.after(fault))
                grew = True
    return allowed, cover


def holds_from_logs(lines: Iterable[str], worker: str, atomic: set[str]) -> list[dict[str, Any]]:
    """Each time an atomic handler (a target in ``atomic``) ran to its timeout, from a
    worker's log: a ``poison_hang`` fault from the timeout's start to the attempt's
    ``timer.error`` line (logged once its batch committed), with the timer's id.

    An atomic handler runs on the worker's loop, so while it hangs the worker serves none
    of its shards. Read from the log, each attempt's hold is where it was; the estimate
    :func:`chaos.checker.check` falls back on (attempts x timeout before the dead letter)
    misses the holds of other poisons between a timer's attempts, which then break a
    chain of holds in two (seed 20261202: four holds of three poisons in a row held one
    worker for 25 s). Log times are this machine's local time, like the run's clock.
    """
    holds = []
    for line in lines:
        match = TIMED_OUT.match(line)
        if not match or match[4] not in atomic:
            continue
        stamp, millis, timer_id, _target, attempt, timeout_s = match.groups()
        end = _log_ms(stamp, millis)
        start = end - int(float(timeout_s) * 1000) - HOLD_SLACK_MS
        holds.append(
            {
                "kind": "poison_hang",
                "start_ms": start,
                "end_ms": end,
                "target": f"{worker} timer {timer_id} attempt {attempt}",
                "timer_id": int(timer_id),
            }
        )
    return holds


def thread_holds_from_logs(lines: Iterable[str], worker: str, threads: int) -> list[dict[str, Any]]:
    """Each time all ``threads`` handler threads of a worker were held by external handlers
    that ran to their timeout, from its log: a ``threads_held`` fault for that span.

    An external handler runs on a handler thread, not the loop; one that hangs holds its
    thread until :meth:`durable.worker.external.ExternalRunner.reap` abandons it. The
    worker claims no more external timers than it has free threads and parks the rest
    (documented), so while every thread hangs its due external timers wait, by design
    (seed 20261203: four hanging external poisons held all four of w2's threads). Each
    hang counts from its ``timer.timeout`` line back by its timeout: the line comes when
    the loop abandoned it, at or after its deadline, so the span is never longer than the
    hold was (a shorter saturation, a stricter bound).
    """
    edges: list[tuple[int, int]] = []  # (ms, +1 a hang starts / -1 it ends)
    for line in lines:
        match = ABANDONED.match(line)
        if not match:
            continue
        stamp, millis, _timer_id, _target, _attempt, timeout_s = match.groups()
        end = _log_ms(stamp, millis)
        edges += [(end - int(float(timeout_s) * 1000), 1), (end, -1)]
    held: list[dict[str, Any]] = []
    busy, since = 0, 0
    for at, step in sorted(edges):  # at a tie an end (-1) comes first: no false overlap
        busy += step
        if step > 0 and busy == threads:
            since = at
        elif step < 0 and busy == threads - 1:
            held.append(
                {
                    "kind": "threads_held",
                    "start_ms": since,
                    "end_ms": at,
                    "target": f"{worker}: all {threads} handler threads hang",
                }
            )
    return held


def _log_ms(stamp: str, millis: str) -> int:
    """Epoch ms of a log line's time (this machine's local time, like the run's clock)."""
    return int(time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) * 1000) + int(millis)


def retries_from_logs(lines: Iterable[str]) -> dict[int, list[tuple[int, int]]]:
    """Timer id → ``(failed, retry due)`` of each failed attempt in a worker's log: when
    its ``timer.error`` line was logged (once the failure committed) and that plus the
    longest backoff durable's default policy waits before the retry.

    A fault can fail an attempt (a handler whose own session is terminated, a batch
    rolled back under it); the timer is then retried after its backoff, by design, and
    the recovery bounds count from that retry, not from the first due time.
    """
    retries: dict[int, list[tuple[int, int]]] = {}
    for line in lines:
        match = FAILED.match(line)
        if match:
            stamp, millis, timer_id, attempt = match.groups()
            failed = _log_ms(stamp, millis)
            due = failed + BACKOFF_BASE_MS * 2 ** (int(attempt) - 1)
            retries.setdefault(int(timer_id), []).append((failed, due))
    return retries


def retry_due(due: int, fired: int, retries: list[tuple[int, int]]) -> int:
    """When a fire at ``fired`` was due: after the last attempt that failed before it,
    its retry (no later than the fire itself); with none, ``due``."""
    before = [(failed, again) for failed, again in retries if failed < fired]
    return max(due, min(max(before)[1], fired)) if before else due


def check_lateness(history: History, idx: Any, v: Verdict) -> None:
    """The ``lateness_within_bound`` invariant (:func:`chaos.checker.check`): each fire's
    lateness against the bound of the worst fault that could explain it; ``idx`` is the
    checker's index of the history."""
    bounds = history.bounds
    faults = [f for f in history.faults if f["kind"] not in ("restart", "lock_error")]
    faults += history.holds
    logged = {hold["timer_id"] for hold in history.holds if "timer_id" in hold}
    for op in idx.by_kind["poison"]:
        timer = idx.timer_by_id.get(op.get("timer_id"))
        if timer and timer["id"] in logged:
            continue  # its holds are known exactly
        if timer and op["poison"] == "hang" and op["handler"] == "atomic_poison":
            # It holds its worker's loop for the timeout, on each attempt, ending at its
            # last update (the dead letter).
            end = timer.get("updated_ms") or op["due_ms"]
            spent = timer["attempts"] * bounds.atomic_timeout_s * 1000 + 1000
            start = max(op["due_ms"], int(end - spent))
            faults.append(
                {"kind": "poison_hang", "start_ms": start, "end_ms": end, "target": op["op"]}
            )
    samples: list[tuple[str, int, int]] = []  # (what, due, fired)
    for op in idx.by_kind["timer"]:
        fires = idx.fires(op["op"])
        if op["status"] == "committed" and fires and op.get("fail_times", 0) == 0:
            move = idx.moves.get(op["op"])
            due = move["due_ms"] if move else op["due_ms"]
            fired = min(fires)[0]
            failed = [
                r for t in idx.timers.get(op["op"], []) for r in history.retries.get(t["id"], [])
            ]
            samples.append((op["op"], retry_due(due, fired, failed), fired))
    for key, fired, due in history.ledger:
        if due is not None and not key.startswith("t"):
            samples.append((key, due, fired))
    worst: dict[str, int] = {}
    for what, due, fired in samples:
        allowed, cover = explain(due, fired, faults, bounds)
        if cover:
            # The fault that explains the most lateness; figures count from its end (a
            # freeze's SIGCONT, a lock's release; a kill's is its start).
            culprit = max(cover, key=lambda f: f["start_ms"] + bounds.after(f))
            end = culprit.get("end_ms", culprit["start_ms"])
            kind, late = culprit["kind"], fired - max(due, end)
        else:
            kind, late = "none", fired - due
        if late >= worst.get(kind, -1):
            worst[kind] = late
            v.worst[kind] = f"{what}: due {due}, fired {fired}" + (
                f", {kind} at {culprit['start_ms']} ({culprit.get('target')})" if cover else ""
            )
        v.checked["lateness_within_bound"] += 1
        if fired <= allowed and fired > explain(due, fired, faults, bounds, chain=False)[0]:
            v.chained += 1
        if fired > allowed:
            near = [f"{f['kind']}@{f['start_ms']}" for f in cover] or ["no fault"]
            v.flag(
                "lateness_within_bound",
                f"{what}: due {due}, fired {fired} ({fired - due} ms late), allowed "
                f"{allowed - due} ms; faults: {', '.join(near)}",
            )
    v.lateness = worst
