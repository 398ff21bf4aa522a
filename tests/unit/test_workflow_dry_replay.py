"""The dry mode of the replay-only backend (``ReplayOnlyBackend(dry=True)``), which
``durable_check_runs`` uses: the end of the history stops the replay instead of failing it,
and everything recorded is still checked. No database: the histories are the golden ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from durable.exceptions import NonDeterminismError
from durable.workflows.context import WorkflowContext
from durable.workflows.execute import FAILED, SUSPENDED, execute
from durable.workflows.history import EndOfHistory, ReplayOnlyBackend, load
from durable.workflows.records import Record, StepPolicy
from durable.workflows.registry import workflows
from testproject.demo import workflows as _registers_onboarding  # noqa: F401
from tests.unit.test_workflow_golden import changed_fulfil

HISTORIES = Path(__file__).parents[1] / "histories"


def run(history: dict, records: list[Record], *, dry: bool, definition=None):
    definition = definition or workflows.resolve(history["workflow"])
    backend = ReplayOnlyBackend(records, int(history.get("exported_ms", 0)), dry=dry)
    ctx = WorkflowContext(
        run_id="dry", history=records, backend=backend, policy=StepPolicy(), strict=False
    )
    instance = None
    if definition.model is not None:
        instance = definition.model()
        instance.pk = history["bound"]["pk"]
    args, kwargs = history["args"], history["kwargs"]
    return ctx, execute(ctx, lambda c: definition.invoke(c, instance, args, kwargs))


@pytest.mark.parametrize("cut", [0, 1, 3, 5])
def test_a_cut_history_fails_a_golden_replay_but_stops_a_dry_one(cut):
    history = load(HISTORIES / "onboarding_v2.json")
    records = [Record.from_json(step) for step in history["steps"][:cut]]
    ctx, outcome = run(history, records, dry=True)
    assert outcome.state == SUSPENDED and isinstance(ctx.interrupt, EndOfHistory)
    assert f"seq {cut}: the history ends here" in str(ctx.interrupt)
    with pytest.raises(NonDeterminismError, match=f"seq {cut}: the history ends here"):
        run(history, records, dry=False)


def test_a_dry_replay_still_checks_every_recorded_call():
    history = load(HISTORIES / "order_fulfil_waiting.json")
    records = [Record.from_json(step) for step in history["steps"]]
    _, outcome = run(history, records, dry=True, definition=changed_fulfil())
    assert outcome.state == FAILED
    assert (outcome.error.seq, outcome.error.found) == (0, "step charge")


def test_a_dry_replay_never_runs_a_step():
    calls = []
    history = {"workflow": "x", "args": [], "kwargs": {}, "exported_ms": 0}

    def code(ctx):
        ctx.step(calls.append, 1)

    backend = ReplayOnlyBackend([], 0, dry=True)
    ctx = WorkflowContext(run_id="d", history=[], backend=backend, policy=StepPolicy())
    assert execute(ctx, code).state == SUSPENDED and calls == [] and history
