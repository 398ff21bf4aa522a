"""Golden histories: export a run's recorded steps to JSON and replay code against them.

A history file is what the database holds of one run: the workflow's name, its
arguments, the bound row (if any) and the recorded steps, plus how the run stood when
it was exported (``completed`` with its result, ``failed``, or ``suspended`` at a
wait). :func:`check_history` replays today's code against it, without a database and
without running a single step, and raises if the code no longer makes the same calls
in the same order or no longer ends the same way: a change that would break running
workflows fails CI before it reaches production (Temporal's replayer does this).

    {"workflow": "shop.workflows.fulfil", "run_id": "r1", "args": [7], "kwargs": {},
     "bound": null, "exported_ms": 1900000000000,
     "outcome": {"state": "completed", "result": "shipped"},
     "steps": [{"seq": 0, "kind": "step", "name": "reserve", "status": "done",
                "result": true}, ...]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from durable.conf import get_settings
from durable.core.clock import current_clock
from durable.exceptions import NonDeterminismError
from durable.storage import workflows as store
from durable.workflows.context import WorkflowContext
from durable.workflows.execute import COMPLETED, FAILED, SUSPENDED, Outcome, execute
from durable.workflows.planning import target_of
from durable.workflows.records import ChildRequest, Record, StepCall, Suspend
from durable.workflows.registry import WorkflowDef, workflows


class EndOfHistory(Suspend):
    """A dry replay reached the end of the recorded history: all of it matched."""


class ReplayOnlyBackend:
    """A backend that performs nothing: every call must already be in the history.

    Its clock is frozen at ``now_ms`` (the export time), so waits that had not ended
    then suspend again. A call past the end of the history raises
    :class:`NonDeterminismError`, or, with ``dry=True``, stops the replay there with
    :class:`EndOfHistory` (the code matched everything recorded; what comes next is new
    work, not a divergence): ``manage.py durable_check_runs`` checks unfinished runs so.
    """

    def __init__(self, history: list[Record], now_ms: int, *, dry: bool = False) -> None:
        self._recorded = {record.seq for record in history}
        self._now_ms = now_ms
        self._dry = dry

    def now_ms(self) -> int:
        """The export time."""
        return self._now_ms

    def _past_end(self, seq: int, what: str) -> NonDeterminismError:
        if self._dry:
            raise EndOfHistory(f"seq {seq}: the history ends here; the code goes on to {what}")
        return NonDeterminismError(
            f"seq {seq}: the history ends here but the code now calls {what}",
            seq=seq,
            recorded="(end of history)",
            found=what,
        )

    def note(self, record: Record) -> None:
        """Accept settling a recorded wait; refuse a new value."""
        if record.seq not in self._recorded:
            raise self._past_end(record.seq, f"{record.kind} {record.name!r}")

    def run_step(self, call: StepCall) -> Record:
        """Refuse: a golden replay never runs a step."""
        raise self._past_end(call.seq, f"{call.kind} {call.name!r}")

    def suspend(self, record: Record) -> Record:
        """Suspend at a recorded wait; refuse a new one."""
        if record.seq not in self._recorded:
            raise self._past_end(record.seq, f"{record.kind} {record.name!r}")
        raise Suspend(f"waiting at seq {record.seq}")

    def wait_signal(self, seq: int, name: str, deadline_ms: int | None) -> Record:
        """Suspend at a recorded signal wait; refuse a new one."""
        return self.suspend(Record(seq=seq, kind="signal", name=name))

    def start_child(self, seq: int, request: ChildRequest) -> Record:
        """Refuse: the child start would be new."""
        raise self._past_end(seq, f"child {request.name!r}")

    def wait_child(self, seq: int, run_id: str) -> Record:
        """Suspend at a recorded child wait; refuse a new one."""
        return self.suspend(Record(seq=seq, kind="wait_child", name=run_id))


def load(path: str | Path) -> dict[str, Any]:
    """Read a history file."""
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def replay(history: dict[str, Any], workflow: Any = None) -> Outcome:
    """Replay ``workflow`` (default: the one the history names) against ``history``.

    Raises :class:`NonDeterminismError` if the code calls past the end of the history;
    a mismatch inside it comes back as a failed outcome carrying that error.
    """
    definition = _definition(history, workflow)
    records = [Record.from_json(step) for step in history["steps"]]
    ctx = WorkflowContext(
        run_id=str(history.get("run_id", "golden")),
        history=records,
        backend=ReplayOnlyBackend(records, int(history.get("exported_ms", 0))),
        policy=definition.policy(),
        strict=definition.strict,
    )
    instance = _instance(definition, history.get("bound"))
    args, kwargs = list(history.get("args", [])), dict(history.get("kwargs", {}))
    return execute(ctx, lambda c: definition.invoke(c, instance, args, kwargs))


def check_history(history: dict[str, Any] | str | Path, workflow: Any = None) -> Outcome:
    """Replay and require the recorded ending; raise :class:`NonDeterminismError` if not.

    ``completed`` must complete with an equal result, ``suspended`` must suspend, and
    ``failed`` must fail (with any error).
    """
    if not isinstance(history, dict):
        history = load(history)
    outcome = replay(history, workflow)
    if isinstance(outcome.error, NonDeterminismError):
        raise outcome.error
    expected = history.get("outcome", {}).get("state", COMPLETED)
    if expected in ("sleeping", "waiting", "running", "pending"):
        expected = SUSPENDED
    same = outcome.state == expected
    if same and expected == COMPLETED:
        same = outcome.result == history["outcome"].get("result")
    if not same:
        found = outcome.state if outcome.state != FAILED else f"failed ({outcome.error!r})"
        raise NonDeterminismError(
            f"the history ended {expected} ({history.get('outcome')}) but the code now "
            f"ends {found} with result {outcome.result!r}",
            recorded=expected,
            found=outcome.state,
        )
    return outcome


def export(run_id: str) -> dict[str, Any]:
    """A run's history as a golden-history dict (write it with ``json.dump``)."""
    db = get_settings().DATABASE
    run = store.runs(db).get(pk=run_id)
    outcome: dict[str, Any] = {"state": run.state}
    if run.state == COMPLETED:
        outcome["result"] = run.result
    elif run.error:
        outcome["error"] = run.error
    bound = {"model": run.model_label, "pk": run.object_pk} if run.model_label else None
    return {
        "workflow": run.name,
        "run_id": run.pk,
        "args": run.args,
        "kwargs": run.kwargs,
        "bound": bound,
        "exported_ms": current_clock().now_ms(),
        "outcome": outcome,
        "steps": [Record(**step).to_json() for step in store.history(db, run_id)],
    }


def _definition(history: dict[str, Any], workflow: Any) -> WorkflowDef:
    if workflow is None:
        return workflows.resolve(str(history["workflow"]))
    if isinstance(workflow, WorkflowDef):
        return workflow
    return target_of(workflow)[0]


def _instance(definition: WorkflowDef, bound: dict[str, Any] | None) -> Any:
    # An unsaved instance with just its primary key: workflow code reads its row
    # through steps, whose results are in the history, so nothing else is needed.
    if definition.model is None or not bound:
        return None
    instance = definition.model()
    instance.pk = definition.model._meta.pk.to_python(bound["pk"])
    return instance
