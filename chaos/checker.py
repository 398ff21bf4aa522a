"""The history checker: pure functions from what happened to the promises it broke.

Input (:class:`History`): the load generator's JSONL records (what committed, rolled back,
or ended in doubt), the nemesis's fault log, the ledger (``FireRecord`` rows the chaos
handlers and steps wrote, stamped with the database clock), and the final state of the
durable tables (timers, workflow runs, schedules). Output (:class:`Verdict`): every
invariant with its violations (each naming the operation and timer ids involved),
operation and fault counts, and the worst lateness after each kind of fault.

No database, no Django: ``tests/unit/test_chaos_checker.py`` feeds it small hand-made
histories containing each kind of violation.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from chaos.celery_check import CELERY_INVARIANTS, check_celery
from chaos.lateness import Bounds, check_lateness

__all__ = ["INVARIANTS", "Bounds", "History", "Verdict", "check"]

INVARIANTS = (
    "atomic_exactly_once",
    "external_at_least_once",
    "never_lost",
    "never_early",
    "rolled_back_never_fired",
    "cancelled_never_fired",
    "key_scheduled_once",
    "on_complete_once",
    "workflow_completed_right",
    "workflow_atomic_once",
    "signal_consumed_once",
    "cron_occurrence_once",
    "poison_dead_lettered",
    "nothing_stuck",
    "lateness_within_bound",
    *CELERY_INVARIANTS,
)
FINISHED = {"fired", "failed", "canceled"}


@dataclass(slots=True, kw_only=True)
class History:
    """Everything the checker reads (plain data: lists of dicts and tuples)."""

    ops: list[dict[str, Any]]
    faults: list[dict[str, Any]] = field(default_factory=list)
    ledger: list[tuple[str, int, int | None]] = field(default_factory=list)
    """``(key, fired_at_ms by the database clock, due_at_ms or None)``."""
    timers: list[dict[str, Any]] = field(default_factory=list)
    """Timer rows: id, state, target, args, attempts, max_attempts, fire_at_ms, key."""
    runs: list[dict[str, Any]] = field(default_factory=list)
    """WorkflowRun rows: id, name, state, result."""
    schedules: list[dict[str, Any]] = field(default_factory=list)
    """CronSchedule rows: name, next_ms, skipped_count."""
    holds: list[dict[str, Any]] = field(default_factory=list)
    """Holds of a worker's loop by an atomic handler that ran to its timeout, read from
    the worker logs (:func:`chaos.lateness.holds_from_logs`): ``poison_hang`` faults with
    their ``timer_id``. A hanging poison with none is estimated from its row instead.
    Also the spans in which hanging external handlers held all of a worker's handler
    threads (:func:`chaos.lateness.thread_holds_from_logs`): ``threads_held`` faults."""
    retries: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """Timer id → ``(failed, retry due)`` of its failed attempts, from the worker logs
    (:func:`chaos.lateness.retries_from_logs`): a retry's lateness counts from its due."""
    deliveries: list[dict[str, Any]] = field(default_factory=list)
    """Runs of the Celery tasks by the run's Celery worker (:mod:`chaos.celery_check`)."""
    published: dict[int, list[int]] = field(default_factory=dict)
    """Timer id → when the broker took each of its Celery messages, from the worker logs."""
    celery: dict[str, Any] | None = None
    """The Celery part's broker, queue and consumer error; None: the run had none."""
    end_ms: int = 0
    """When the drain ended: nothing due before it may still be pending."""
    bounds: Bounds = field(default_factory=Bounds)


@dataclass(slots=True, kw_only=True)
class Verdict:
    """The checker's findings."""

    violations: dict[str, list[str]] = field(default_factory=dict)
    ops: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    lateness: dict[str, int] = field(default_factory=dict)
    """Worst lateness (ms) after each fault kind, counted from the fault's end (or the
    due time, if later); ``none``: work no fault could have delayed, counted from its due
    time. Each late fire counts for the fault that explains the most lateness."""
    worst: dict[str, str] = field(default_factory=dict)
    """For each kind in :attr:`lateness`, the fire behind the figure (ids and times)."""
    reported: frozenset[str] = frozenset()
    """Invariants whose violations are reported without failing the run."""
    checked: Counter[str] = field(default_factory=Counter)
    """How many items each invariant looked at."""
    celery: dict[str, Any] | None = None
    """:attr:`History.celery` with the count of messages, for the report."""
    chained: int = 0
    """Fires within their bound only because a fault struck during the recovery from
    another (see :func:`chaos.lateness.explain`)."""

    @property
    def ok(self) -> bool:
        """True when no invariant that fails the run has a violation."""
        return not any(v for name, v in self.violations.items() if name not in self.reported)

    def flag(self, invariant: str, message: str) -> None:
        self.violations.setdefault(invariant, []).append(message)


class _Index:
    """The history grouped by operation."""

    def __init__(self, history: History) -> None:
        self.ledger: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
        for key, fired, due in history.ledger:
            self.ledger[key].append((fired, due))
        self.timers: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.timer_by_id = {t["id"]: t for t in history.timers}
        for timer in history.timers:
            args = timer.get("args") or []
            if args and isinstance(args[0], str):
                self.timers[args[0]].append(timer)
        self.runs = {r["id"]: r for r in history.runs}
        self.by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for op in history.ops:
            self.by_kind[op["kind"]].append(op)
        self.cancels: dict[str, dict[str, Any]] = {}
        for op in self.by_kind["cancel"]:
            if op["status"] == "committed" and op.get("result"):
                self.cancels[op["op"]] = op
        self.moves: dict[str, dict[str, Any]] = {}
        for op in self.by_kind["reschedule"]:
            if op["status"] == "committed" and op.get("result"):
                self.moves[op["op"]] = op
        self.children: dict[str, list[str]] = defaultdict(list)
        for op in self.by_kind["timer"]:
            if op.get("parent_op"):
                self.children[op["parent_op"]].append(op["op"])

    def fires(self, key: str) -> list[tuple[int, int | None]]:
        return self.ledger.get(key, [])

    def cancel_of(self, op: dict[str, Any]) -> dict[str, Any] | None:
        """The committed successful cancel of ``op`` or of its parent, if any."""
        return self.cancels.get(op["op"]) or (
            self.cancels.get(op["parent_op"]) if op.get("parent_op") else None
        )

    def final_state(self, op: str) -> str:
        """``fired`` if any of the op's rows fired (a reschedule adds a row), else the last's."""
        rows = sorted(self.timers.get(op, []), key=lambda t: t["id"])
        if any(t["state"] == "fired" for t in rows):
            return "fired"
        return rows[-1]["state"] if rows else "missing"


def check(history: History, *, report_only: frozenset[str] = frozenset()) -> Verdict:
    """Check every promise against ``history``; see the module docstring.

    ``report_only``: invariants whose violations are counted and printed but do not
    make :attr:`Verdict.ok` false.
    """
    verdict = Verdict(reported=report_only)
    idx = _Index(history)
    verdict.ops.update(
        f"{op['kind']}:{op['status']}" if op["status"] != "committed" else op["kind"]
        for op in history.ops
    )
    verdict.faults.update(f["kind"] for f in history.faults if f["kind"] not in ("restart",))
    _timers(history, idx, verdict)
    _keys(idx, verdict)
    _workflows(idx, verdict)
    _crons(history, idx, verdict)
    _poison(idx, verdict)
    _ledger_early(history, verdict)
    _stuck(history, verdict)
    check_lateness(history, idx, verdict)
    check_celery(history, idx.timers, verdict)
    if history.celery is not None:
        verdict.celery = {**history.celery, "delivered": len(history.deliveries)}
    for name in INVARIANTS:
        verdict.violations.setdefault(name, [])
    return verdict


def _timers(history: History, idx: _Index, v: Verdict) -> None:
    for op in idx.by_kind["timer"]:
        name, status = op["op"], op["status"]
        fires = idx.fires(name)
        atomic = op["handler"] in ("atomic", "flaky")
        ids = f"op {name} timer {op.get('timer_id')}"
        if status == "rolled_back":
            v.checked["rolled_back_never_fired"] += 1
            if fires or idx.timers.get(name):
                v.flag("rolled_back_never_fired", f"{ids}: rolled back, yet {len(fires)} fires")
            continue
        if status == "unknown":
            if atomic and len(fires) > 1:
                v.flag("atomic_exactly_once", f"{ids} (commit in doubt): {len(fires)} fires")
            continue
        state = idx.final_state(name)
        cancel = idx.cancel_of(op)
        if cancel is not None:
            v.checked["cancelled_never_fired"] += 1
            own = cancel["op"] == name
            late = [f for f, _ in fires if f > cancel["t1"]]
            # A child that was firing when its parent's cancel came is not cancelled: only
            # a pending one is, and an atomic one fires (commits) all at once.
            if (own and state == "fired") or (late and (own or atomic or state == "canceled")):
                v.flag(
                    "cancelled_never_fired",
                    f"{ids}: cancel of {cancel['op']} committed by {cancel['t1']}, "
                    f"state {state}, fired at {late or [f for f, _ in fires]}",
                )
        else:
            v.checked["never_lost"] += 1
            if state != "fired":
                error = max(idx.timers.get(name, []), key=lambda t: t["id"], default={})
                v.flag(
                    "never_lost",
                    f"{ids}: committed, never cancelled, final state {state} "
                    f"{error.get('last_error', '')[:160]!r}",
                )
        if atomic:
            v.checked["atomic_exactly_once"] += 1
            if len(fires) != (1 if state == "fired" else 0):
                v.flag("atomic_exactly_once", f"{ids}: state {state}, {len(fires)} fires")
        elif state == "fired":
            v.checked["external_at_least_once"] += 1
            if not fires:
                v.flag("external_at_least_once", f"{ids}: fired, but no effect in the ledger")
        move = idx.moves.get(name)
        due = move["due_ms"] if move else op["due_ms"]
        v.checked["never_early"] += len(fires)
        for fired, _ in fires:
            if fired < due:
                v.flag("never_early", f"{ids}: fired at {fired}, due {due} ({fired - due} ms)")
        if op.get("on_complete") and state in FINISHED:
            v.checked["on_complete_once"] += 1
            follow = [k for k in idx.ledger if k.startswith(f"{name}:oc:")]
            count = sum(len(idx.ledger[k]) for k in follow)
            if count != 1:
                v.flag("on_complete_once", f"{ids}: state {state}, follow-ups {follow} x{count}")


def _keys(idx: _Index, v: Verdict) -> None:
    for op in idx.by_kind["dup"]:
        if op["status"] != "committed":
            continue
        v.checked["key_scheduled_once"] += 1
        if op.get("again_id") != op.get("timer_id") or idx.fires(op["op"]):
            v.flag(
                "key_scheduled_once",
                f"op {op['op']}: key of {op['of']} (timer {op.get('timer_id')}) scheduled again "
                f"gave timer {op.get('again_id')}, {len(idx.fires(op['op']))} fires",
            )


def _workflows(idx: _Index, v: Verdict) -> None:
    for op in idx.by_kind["workflow"]:
        name = op["op"]
        keys = [k for k in idx.ledger if k == name or k.startswith(f"{name}:")]
        if op["status"] == "rolled_back":
            v.checked["rolled_back_never_fired"] += 1
            if keys or name in idx.runs:
                v.flag("rolled_back_never_fired", f"run {name}: rolled back, yet ran {keys}")
            continue
        if op["status"] != "committed":
            continue
        v.checked["workflow_completed_right"] += 1
        run = idx.runs.get(name)
        payload = f"p-{name}" if op["signal"] else None
        kid = f"{name}:kid" if op["child"] else None
        total = sum(i * i + i + 1 for i in range(op["steps"]))
        want = {"op": name, "total": total, "signal": payload, "child": kid}
        if run is None or run["state"] != "completed" or run.get("result") != want:
            got = (run["state"], run.get("result")) if run else "no run"
            v.flag("workflow_completed_right", f"run {name}: {got}, expected completed {want}")
        once = [f"{name}:atomic{i}" for i in range(op["steps"])]
        once += [f"{name}:woke"] if op["sleep_ms"] else []
        once += [kid] if kid else []
        v.checked["workflow_atomic_once"] += len(once)
        for key in once:
            if len(idx.fires(key)) != 1:
                v.flag("workflow_atomic_once", f"run {name}: {key} ran {len(idx.fires(key))}x")
        for i in range(op["steps"]):
            if not idx.fires(f"{name}:step{i}"):
                v.flag("workflow_atomic_once", f"run {name}: outside step {i} never ran")
        if payload:
            v.checked["signal_consumed_once"] += 1
            took = [k for k in keys if k.startswith(f"{name}:signal:")]
            count = sum(len(idx.fires(k)) for k in took)
            if took != [f"{name}:signal:{payload}"] or count != 1:
                v.flag("signal_consumed_once", f"run {name}: signal effects {took} x{count}")


def _crons(history: History, idx: _Index, v: Verdict) -> None:
    rows = {s["name"]: s for s in history.schedules}
    for op in idx.by_kind["cron"]:
        if op["status"] != "committed":
            continue
        name = op["name"]
        prefix = f"cron:{name}:"
        occurrences = Counter(
            int(k[len(prefix) :]) for k in idx.ledger for _ in idx.ledger[k] if k.startswith(prefix)
        )
        v.checked["cron_occurrence_once"] += len(occurrences)
        dups = {o: n for o, n in occurrences.items() if n > 1}
        if dups:
            v.flag("cron_occurrence_once", f"schedule {name}: occurrences run twice {dups}")
        row = rows.get(name)
        if row is None or row.get("next_ms") is None:
            continue
        span = (row["next_ms"] - op["first_ms"]) // op["interval_ms"]
        counted = len(occurrences) + row.get("skipped_count", 0)
        if counted != span:
            v.flag(
                "cron_occurrence_once",
                f"schedule {name}: {len(occurrences)} run + {row.get('skipped_count', 0)} "
                f"skipped != {span} occurrences up to {row['next_ms']}",
            )


def _poison(idx: _Index, v: Verdict) -> None:
    for op in idx.by_kind["poison"]:
        if op["status"] != "committed":
            continue
        v.checked["poison_dead_lettered"] += 1
        timer = idx.timer_by_id.get(op["timer_id"])
        if timer is None or timer["state"] != "failed" or timer["attempts"] > timer["max_attempts"]:
            got = (timer["state"], timer["attempts"], timer["max_attempts"]) if timer else None
            v.flag(
                "poison_dead_lettered",
                f"op {op['op']} timer {op['timer_id']} ({op['handler']} {op['poison']}): "
                f"(state, attempts, max) = {got}",
            )


def _ledger_early(history: History, v: Verdict) -> None:
    """Every ledger row that knows its due time ran at or after it (timers: their row's)."""
    for key, fired, due in history.ledger:
        if due is not None:
            v.checked["never_early"] += 1
            if fired < due:
                v.flag("never_early", f"{key}: fired at {fired}, due {due} ({fired - due} ms)")


def _stuck(history: History, v: Verdict) -> None:
    grace = int(history.bounds.lease_ttl_s * 1000)
    for timer in history.timers:
        v.checked["nothing_stuck"] += 1
        overdue = timer["state"] == "pending" and timer["fire_at_ms"] < history.end_ms - grace
        if timer["state"] == "firing" or overdue:
            v.flag(
                "nothing_stuck",
                f"timer {timer['id']} ({timer['target']} {timer.get('args')}) left "
                f"{timer['state']}, due {timer['fire_at_ms']}, drain ended {history.end_ms}",
            )
    for run in history.runs:
        if run["state"] in ("running", "pending"):
            v.flag("nothing_stuck", f"run {run['id']} left {run['state']}")
