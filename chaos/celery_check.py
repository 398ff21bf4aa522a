"""The Celery dispatch invariants of the chaos run's checker (pure, like :mod:`chaos.checker`).

Reads the load's ``celery`` operations (each a ``durable.schedule_celery`` timer with its
outcome, timer id and due time), their cancels, the timer rows, the faults, and the
deliveries: each run of the task by the run's stock Celery worker
(:mod:`chaos.celery_dispatch`: task id, operation, when it ran by this machine's clock),
and when the broker took each message (the workers' ``celery.published`` log lines). The
promises (docs/how-to/replace-celery-eta.md):

- ``celery_delivered``: each committed dispatch timer never cancelled was published,
  its row is ``fired``, and the Celery worker ran its task at least once; every run
  belongs to a dispatch timer of the load.
- ``celery_dup_same_id_at_fault``: every message carries its timer's task id
  (``durable-<timer id>``, the idempotency key a task dedupes by), and a timer's second
  and later messages come only across a fault (a worker killed, frozen, cut from the
  database or held up between the publish and its batch's commit): some fault's span
  lies between the first message and this one, or overlaps one of them. (How soon the
  message comes again is lateness's business, not this invariant's.)
- ``celery_never_early``: no task ran before its timer was due.
- ``celery_rolled_back_unsent``: a timer whose transaction rolled back sent nothing.
- ``celery_cancelled_unsent``: a timer whose cancel committed (``cancel`` returned True)
  sent nothing after that commit, and its row is not ``fired``. A task that ran after
  the commit is allowed only if its message was published before it (a batch published
  it, then died or rolled back before its commit, leaving the row to the cancel; the
  Celery worker ran it a little later).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chaos.checker import History, Verdict

CELERY_INVARIANTS = (
    "celery_delivered",
    "celery_dup_same_id_at_fault",
    "celery_never_early",
    "celery_rolled_back_unsent",
    "celery_cancelled_unsent",
)
#: A fault may strike just before the consumer logged the message of the publish it
#: interrupted (the broker delivers while the worker waits for its confirm).
FAULT_SLACK_MS = 2000


def task_id_for(timer_id: Any) -> str:
    """The task id durable gives a dispatch timer's message (durable.dispatch.celery)."""
    return f"durable-{timer_id}"


def check_celery(history: History, timers: dict[str, list[dict[str, Any]]], v: Verdict) -> None:
    """Check every dispatch timer of ``history`` against the deliveries; flag into ``v``.

    ``timers``: the timer rows by the operation in their first argument."""
    got: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for delivery in history.deliveries:
        got[str(delivery.get("op"))].append(delivery)
    for found in got.values():
        found.sort(key=lambda d: d["at_ms"])
    ops = [op for op in history.ops if op["kind"] == "celery"]
    cancels = {
        op["op"]: op
        for op in history.ops
        if op["kind"] == "cancel" and op["status"] == "committed" and op.get("result")
    }
    faults = [f for f in history.faults if f["kind"] != "restart"] + history.holds
    for op in ops:
        rows = timers.get(op["op"], [])
        sent = history.published.get(op.get("timer_id") or 0, [])
        _one(op, got.pop(op["op"], []), rows, sent, cancels, faults, v)
    for name, stray in sorted(got.items()):
        v.checked["celery_delivered"] += 1
        ids = sorted({str(d.get("task_id")) for d in stray})
        v.flag("celery_delivered", f"op {name}: {len(stray)} messages {ids} of no dispatch timer")


def _one(
    op: dict[str, Any],
    got: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    sent: list[int],
    cancels: dict[str, dict[str, Any]],
    faults: list[dict[str, Any]],
    v: Verdict,
) -> None:
    name, status = op["op"], op["status"]
    ids = f"op {name} timer {op.get('timer_id')}"
    at = [d["at_ms"] for d in got]
    if status == "rolled_back":
        v.checked["celery_rolled_back_unsent"] += 1
        if got or rows:
            v.flag("celery_rolled_back_unsent", f"{ids}: rolled back, yet {len(got)} messages")
        return
    if got and status == "committed":
        v.checked["celery_dup_same_id_at_fault"] += 1
        want = task_id_for(op["timer_id"])
        wrong = sorted({str(d.get("task_id")) for d in got} - {want})
        if wrong:
            v.flag("celery_dup_same_id_at_fault", f"{ids}: task ids {wrong}, expected {want}")
        for later in at[1:]:
            if not _across_fault(at[0], later, faults):
                v.flag(
                    "celery_dup_same_id_at_fault",
                    f"{ids}: message again at {later} ({later - at[0]} ms after the first "
                    f"at {at[0]}) with no fault between",
                )
    if status != "committed":
        return  # commit in doubt: it may or may not have been sent
    state = next((r["state"] for r in rows if r["state"] == "fired"), None)
    state = state or (rows[-1]["state"] if rows else "missing")
    cancel = cancels.get(name)
    if cancel is not None:
        v.checked["celery_cancelled_unsent"] += 1
        late = [t for t in at if t > cancel["t1"]]
        before = any(t <= cancel["t1"] for t in sent)
        if (late and not before) or state == "fired":
            v.flag(
                "celery_cancelled_unsent",
                f"{ids}: cancel committed by {cancel['t1']}, state {state}, ran at {at}, "
                f"published at {sent}",
            )
    else:
        v.checked["celery_delivered"] += 1
        if state != "fired" or not got:
            error = (rows[-1].get("last_error") or "")[:160] if rows else ""
            v.flag(
                "celery_delivered",
                f"{ids}: committed, never cancelled, state {state}, {len(got)} messages {error!r}",
            )
    v.checked["celery_never_early"] += len(at)
    for arrived in at:
        if arrived < op["due_ms"]:
            v.flag(
                "celery_never_early",
                f"{ids}: message at {arrived}, due {op['due_ms']} ({arrived - op['due_ms']} ms)",
            )


def _across_fault(first: int, later: int, faults: list[dict[str, Any]]) -> bool:
    """True if some fault's span (a kill's is its moment) overlaps ``[first, later]``."""
    return any(
        f["start_ms"] <= later and f.get("end_ms", f["start_ms"]) >= first - FAULT_SLACK_MS
        for f in faults
    )
