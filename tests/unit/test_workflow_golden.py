"""Golden replays: today's code against the histories recorded in ``tests/histories/``.

No database and no step runs: the history provides every result. A workflow change that
would send running workflows down another path fails here, in CI, with
``NonDeterminismError`` (Temporal's replayer does the same job).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from durable.exceptions import NonDeterminismError
from durable.workflows.history import check_history, load, replay
from durable.workflows.registry import METHOD, WorkflowDef
from testproject.demo import shop
from testproject.demo import workflows as _registers_onboarding  # noqa: F401 (the histories replay it)
from testproject.demo.models import Order

HISTORIES = sorted((Path(__file__).parents[1] / "histories").glob("*.json"))


def test_there_are_histories_to_replay():
    assert len(HISTORIES) >= 5


@pytest.mark.parametrize("path", HISTORIES, ids=lambda p: p.stem)
def test_current_code_replays_every_recorded_history(path):
    history = load(path)
    outcome = check_history(history)
    if history["outcome"]["state"] == "completed":
        assert outcome.result == history["outcome"]["result"]


def charge_first(self, ctx):
    """Order.fulfil with charging moved before reserving: a breaking change."""
    payment = ctx.step(shop.charge, self.pk, self.total_cents, ctx.idempotency_key)
    ctx.atomic(self.set_status, self.Status.RESERVED)
    ctx.atomic(self.set_status, self.Status.PAID, payment_ref=payment)
    return ctx.wait_for_signal("shipped")


def changed_fulfil() -> WorkflowDef:
    definition = WorkflowDef(
        charge_first, name="golden.changed", shape=METHOD, strict=False,
        max_attempts=None, backoff=None,
    )  # fmt: skip
    definition.model = Order
    return definition


@pytest.mark.parametrize(
    "name", ["order_fulfil_shipped", "order_fulfil_waiting", "order_fulfil_unshipped"]
)
def test_a_reordered_workflow_fails_against_the_recorded_histories(name):
    path = Path(__file__).parents[1] / "histories" / f"{name}.json"
    with pytest.raises(NonDeterminismError) as info:
        check_history(path, changed_fulfil())
    assert info.value.seq == 0
    assert info.value.recorded == "atomic Order.set_status"
    assert info.value.found == "step charge"


def test_a_workflow_that_ends_differently_fails(tmp_path):
    history = load(Path(__file__).parents[1] / "histories" / "order_fulfil_shipped.json")
    history["outcome"]["result"] = "something else"
    with pytest.raises(NonDeterminismError, match="ended completed"):
        check_history(history)
    cut = dict(history, steps=history["steps"][:3])
    cut_path = tmp_path / "cut.json"
    cut_path.write_text(json.dumps(cut))
    with pytest.raises(NonDeterminismError, match="seq 3: the history ends here"):
        check_history(cut_path)


def test_the_old_onboarding_history_skips_the_patch_and_the_new_one_takes_it():
    old = load(Path(__file__).parents[1] / "histories" / "onboarding_v1_before_sms_patch.json")
    new = load(Path(__file__).parents[1] / "histories" / "onboarding_v2.json")
    assert "patched" not in [s["kind"] for s in old["steps"]]
    assert [s["name"] for s in new["steps"] if s["kind"] == "patched"] == ["welcome-sms"]
    assert replay(old).result == old["outcome"]["result"]
    assert replay(new).result == new["outcome"]["result"]
