"""Check unfinished runs against the code installed now, before a deploy: a dry replay.

Each unfinished run (pending, running, sleeping, waiting) is replayed from the top
exactly as the worker would resume it, with the same determinism checks
(:class:`~durable.workflows.replay.ReplayCursor`), against a backend that performs
nothing (:class:`~durable.workflows.history.ReplayOnlyBackend` with ``dry=True``):
recorded calls return their recorded results, no step function runs, no row is
written, and the replay stops where the history ends (the work after it is new, not a
divergence). What would make the run fail once the new code resumes it is reported as a
:class:`Divergence`: a call that differs from the record at some seq, a recorded call
the code no longer makes, a workflow no longer registered (renamed or removed), a bound
row or model that is gone, or the code raising.

Only the workflow code between ctx calls runs; it must be deterministic anyway (see
``docs/discussions/determinism.md``), and anything it does outside ctx calls would also
happen on every real replay.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connections

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.core.errors import sanitize_error
from durable.exceptions import NonDeterminismError, UnknownWorkflow
from durable.storage import histories
from durable.storage.checkpoints import RunSnapshot
from durable.workflows.context import WorkflowContext
from durable.workflows.execute import FAILED, execute
from durable.workflows.history import ReplayOnlyBackend
from durable.workflows.records import Record, StepPolicy
from durable.workflows.registry import WorkflowDef, workflows

#: Why a run would fail once resumed by the code installed now.
NONDETERMINISM = "nondeterminism"
UNKNOWN_WORKFLOW = "unknown_workflow"
BOUND_ROW = "bound_row"
ERROR = "error"


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """A run the installed code would fail, and why (``reason``: see the constants)."""

    run_id: str
    workflow: str
    state: str
    """The run's state now (``sleeping``, ``waiting``...)."""
    reason: str
    seq: int | None = None
    recorded: str = ""
    """The call the history holds at ``seq`` (``step 'charge'``)."""
    found: str = ""
    """What the code does there now (another call, ``return``...)."""
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        """This divergence as a JSON-ready dict (``durable_check_runs --json``)."""
        return {
            "run_id": self.run_id,
            "workflow": self.workflow,
            "state": self.state,
            "reason": self.reason,
            "seq": self.seq,
            "recorded": self.recorded,
            "found": self.found,
            "message": self.message,
        }

    def __str__(self) -> str:
        where = f"seq {self.seq}: " if self.seq is not None else ""
        what = (
            f"recorded {self.recorded}, code now {self.found}"
            if self.recorded or self.found
            else self.message
        )
        return f"run {self.run_id} ({self.workflow}, {self.state}) {self.reason}: {where}{what}"


@dataclass(slots=True, kw_only=True)
class CheckReport:
    """What :func:`check_runs` found: how many runs it replayed, which would fail."""

    checked: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no run would diverge."""
        return not self.divergences

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready dict."""
        return {
            "ok": self.ok,
            "checked": self.checked,
            "diverging": len(self.divergences),
            "seconds": round(self.seconds, 3),
            "runs": [d.to_json() for d in self.divergences],
        }


def check_run(
    snapshot: RunSnapshot,
    state: str,
    instance: Any,
    now_ms: int,
    resolved: dict[str, tuple[WorkflowDef, StepPolicy]] | None = None,
) -> Divergence | None:
    """Replay one run dry (see the module docstring); its divergence, or None if the
    code installed now resumes it. ``instance``: the bound row (None for a function);
    ``resolved``: a cache of definitions and their policies, by name, for many runs."""
    base = {"run_id": snapshot.id, "workflow": snapshot.name, "state": state}
    found = None if resolved is None else resolved.get(snapshot.name)
    if found is None:
        try:
            definition = workflows.resolve(snapshot.name)
        except UnknownWorkflow as exc:
            return Divergence(
                **base,
                reason=UNKNOWN_WORKFLOW,
                recorded=f"workflow {snapshot.name!r}",
                found="(not registered)",
                message=str(exc),
            )
        found = (definition, definition.policy())
        if resolved is not None:
            resolved[snapshot.name] = found
    definition, policy = found
    history = [Record(**step) for step in snapshot.steps]
    ctx = WorkflowContext(
        run_id=snapshot.id,
        history=history,
        backend=ReplayOnlyBackend(history, now_ms, dry=True),
        policy=policy,
        strict=definition.strict,
    )
    args, kwargs = snapshot.args, snapshot.kwargs
    try:
        outcome = execute(ctx, lambda c: definition.invoke(c, instance, args, kwargs))
    except Exception as exc:  # nothing live can fail here; count it as the run's failure
        return Divergence(**base, reason=ERROR, message=sanitize_error(exc))
    if outcome.state != FAILED:
        return None
    error = outcome.error
    if isinstance(error, NonDeterminismError):
        return Divergence(
            **base,
            reason=NONDETERMINISM,
            seq=error.attrs.get("seq"),
            recorded=str(error.attrs.get("recorded", "")),
            found=str(error.attrs.get("found", "")),
            message=str(error),
        )
    return Divergence(**base, reason=ERROR, message=sanitize_error(error or "failed"))


def check_runs(
    *, names: Sequence[str] = (), page: int = 1000, now_ms: int | None = None
) -> CheckReport:
    """Replay every unfinished run dry (only workflows ``names`` if given), ``page`` at a
    time; return the :class:`CheckReport`. Reads the database, writes nothing."""
    db = get_settings().DATABASE
    now = current_clock().now_ms() if now_ms is None else now_ms
    report = CheckReport()
    resolved: dict[str, tuple[WorkflowDef, StepPolicy]] = {}
    started = time.perf_counter()
    for batch in _pages(db, names, page):
        bound = _bound_rows(db, [snapshot for _, snapshot in batch])
        for state, snapshot in batch:
            report.checked += 1
            instance = None
            if snapshot.model_label:
                rows = bound.get(snapshot.model_label)
                instance = None if rows is None else rows.get(snapshot.object_pk)
                if instance is None:
                    report.divergences.append(_row_gone(snapshot, state, rows is None))
                    continue
            divergence = check_run(snapshot, state, instance, now, resolved)
            if divergence is not None:
                report.divergences.append(divergence)
    report.seconds = time.perf_counter() - started
    return report


def _pages(db: str, names: Sequence[str], page: int) -> Iterator[list[tuple[str, RunSnapshot]]]:
    """The unfinished runs, a page at a time. Outside a transaction they are read on a
    thread of their own, a page or two ahead of the caller's replays: reading (the
    database's work) and replaying (this process's) overlap. Inside one (a test's), a
    thread's connection would not see the caller's rows: pages are read in turn."""
    if connections[db].in_atomic_block:
        yield from histories.unfinished_runs(db, names, page)
        return
    ahead: queue.Queue[Any] = queue.Queue(maxsize=2)
    stop = threading.Event()
    reader = threading.Thread(
        target=_read_ahead, args=(db, names, page, ahead, stop), name="durable-check", daemon=True
    )
    reader.start()
    try:
        while (item := ahead.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # the caller stopped early (an error): the reader puts nothing more
        reader.join()


_DONE = object()


def _read_ahead(
    db: str, names: Sequence[str], page: int, ahead: queue.Queue[Any], stop: threading.Event
) -> None:
    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    try:
        for batch in histories.unfinished_runs(db, names, page):
            if not put(batch):
                return
        put(_DONE)
    except Exception as exc:  # the caller raises it
        put(exc)
    finally:
        connections.close_all()  # this thread's own connection


def _bound_rows(db: str, snapshots: list[RunSnapshot]) -> dict[str, dict[str, Any] | None]:
    """The bound rows of the page's runs, one query per model: label -> pk -> row."""
    wanted: dict[str, list[str]] = {}
    for snapshot in snapshots:
        if snapshot.model_label:
            wanted.setdefault(snapshot.model_label, []).append(snapshot.object_pk)
    return {label: histories.bound_rows(db, label, pks) for label, pks in wanted.items()}


def _row_gone(snapshot: RunSnapshot, state: str, model_gone: bool) -> Divergence:
    what = (
        f"the model {snapshot.model_label!r} this run is bound to no longer exists"
        if model_gone
        else f"the {snapshot.model_label} row pk={snapshot.object_pk} this run is bound to "
        "no longer exists"
    )
    return Divergence(
        run_id=snapshot.id, workflow=snapshot.name, state=state, reason=BOUND_ROW, message=what
    )
