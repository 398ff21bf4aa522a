"""``manage.py durable_check_runs``: before a deploy, name exactly the runs the new code
would fail, change nothing; after it, those fail visibly and every other run resumes.

1,000 runs sleeping or waiting under version 1 of a workflow module
(``deploy_support``); version 2 adds a patched step (safe), swaps two steps (breaks the
runs past them) and renames a workflow (breaks all its runs). SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

import durable
from durable.models import Timer, WorkflowRun, WorkflowStep
from durable.storage.checkpoints import RunSnapshot
from durable.testing import time_machine
from durable.workflows.checkruns import check_run, check_runs
from durable.workflows.registry import workflows
from tests.integration import deploy_support as v

pytestmark = pytest.mark.django_db
START = datetime(2031, 5, 4, 8, 0, tzinfo=UTC)
HOUR = timedelta(hours=1)


@pytest.fixture(autouse=True)
def module_v1():
    v.install(1)
    yield
    v.uninstall()


def start(name: str, numbers: range) -> list[str]:
    runs = workflows.resolve(name).start_many({"args": [n]} for n in numbers)
    return [run.pk for run in runs]


def check(*args: str) -> tuple[int, dict]:
    out = StringIO()
    try:
        call_command("durable_check_runs", "--json", *args, stdout=out)
        status = 0
    except CommandError as exc:
        status = exc.returncode
    return status, json.loads(out.getvalue())


def table_state() -> tuple:
    runs = sorted(WorkflowRun.objects.values_list("id", "state", "updated_at", "replays"))
    steps = sorted(WorkflowStep.objects.values_list("run_id", "seq", "status", "result"))
    timers = sorted(Timer.objects.values_list("id", "state", "attempts", "fire_at_ms"))
    return runs, steps, timers


def test_a_deploy_of_1000_runs_names_exactly_the_runs_that_would_fail():
    with time_machine(START) as machine:
        early = start("deploy.reordered", range(100))  # will have recorded b and c
        machine.advance(days=1, hours=1)
        late = start("deploy.reordered", range(100, 200))  # will not have
        sleepers = start("deploy.sleeper", range(400))
        waiters = start("deploy.waiter", range(200))
        patched = start("deploy.patched", range(100))
        renamed = start(v.OLD_NAME, range(100))
        machine.advance(HOUR)
        every = early + late + sleepers + waiters + patched + renamed
        assert len(every) == 1000
        states = dict(WorkflowRun.objects.values_list("id", "state"))
        assert {states[r] for r in every} == {"sleeping", "waiting"}
        status, report = check()  # version 1 resumes every run
        assert (status, report["checked"], report["runs"]) == (0, 1000, [])

        v.install(2)  # the deploy's new code, before any worker runs it
        before = table_state()
        status, report = check()
        assert table_state() == before  # nothing written
        assert status == 1 and report["checked"] == 1000 and not report["ok"]
        named = {d["run_id"]: d for d in report["runs"]}
        assert set(named) == set(early) | set(renamed)
        one = named[early[0]]
        assert (one["reason"], one["seq"]) == ("nondeterminism", 2)
        assert (one["recorded"], one["found"]) == ("step step", "step c")
        assert one["workflow"] == "deploy.reordered" and one["state"] == "sleeping"
        assert {named[r]["reason"] for r in renamed} == {"unknown_workflow"}
        assert named[renamed[0]]["recorded"] == f"workflow {v.OLD_NAME!r}"

        for run_id in waiters:
            durable.send_signal(run_id, "go", "z")
        machine.advance(days=3)
        ended = dict(WorkflowRun.objects.values_list("id", "state"))
        assert {ended[r] for r in every if r not in named} == {"completed"}
        assert {ended[r] for r in named} == {"failed"}  # none stuck
        errors = dict(WorkflowRun.objects.filter(pk__in=early).values_list("id", "error"))
        assert all(e.startswith("NonDeterminismError: seq 2") for e in errors.values())
        assert "unknown workflow" in WorkflowRun.objects.get(pk=renamed[0]).error
        status, report = check()
        assert (status, report["checked"]) == (0, 0)


def test_text_output_names_the_run_seq_and_calls():
    with time_machine(START) as machine:
        (run_id,) = start("deploy.reordered", range(1))
        machine.advance(days=1, minutes=1)
        v.install(2)
        out = StringIO()
        with pytest.raises(CommandError) as info:
            call_command("durable_check_runs", stdout=out)
    assert info.value.returncode == 1
    text = out.getvalue()
    assert f"run {run_id} (deploy.reordered, sleeping) nondeterminism: seq 2:" in text
    assert "recorded step step, code now step c" in text
    assert "checked 1 unfinished run(s)" in text


@pytest.mark.django_db(transaction=True)
def test_filters_by_workflow_and_refuses_a_bad_page_size():
    # Outside a transaction the next page is read on a thread while this one replays.
    with time_machine(START) as machine:
        start("deploy.sleeper", range(3))
        start(v.OLD_NAME, range(2))
        machine.advance()
        v.install(2)
        status, report = check("--workflow", "deploy.sleeper", "--page-size", "2")
        assert (status, report["checked"]) == (0, 3)
        status, report = check("--workflow", v.OLD_NAME)
        assert (status, report["checked"], report["diverging"]) == (1, 2, 2)
    with pytest.raises(CommandError, match="page-size"):
        call_command("durable_check_runs", "--page-size", "0")


def test_a_run_whose_code_returns_early_or_raises_is_reported():
    def shorter(ctx, n):
        ctx.step(v.step, f"a{n}")
        return n

    def raising(ctx, n):
        raise RuntimeError("bad deploy")

    snapshot = RunSnapshot(
        id="r1", name="deploy.sleeper", shard=0, args=[1], kwargs={}, model_label="",
        object_pk="", parent_id=None,
        steps=[
            {"seq": 0, "kind": "step", "name": "step", "status": "done", "result": "a1",
             "error": "", "attempts": 1, "wake_ms": None},
            {"seq": 1, "kind": "sleep", "name": "sleep", "status": "waiting", "result": 5,
             "error": "", "attempts": 0, "wake_ms": 5},
        ],
    )  # fmt: skip
    assert check_run(snapshot, "sleeping", None, now_ms=0) is None
    assert check_run(snapshot, "sleeping", None, now_ms=10) is None  # sleep over: new work
    durable.workflow(name="deploy.sleeper")(shorter)
    found = check_run(snapshot, "sleeping", None, now_ms=0)
    assert (found.reason, found.seq, found.found) == ("nondeterminism", 1, "return")
    durable.workflow(name="deploy.sleeper")(raising)
    found = check_run(snapshot, "sleeping", None, now_ms=0)
    assert found.reason == "error" and "RuntimeError: bad deploy" in found.message
    assert check_runs().checked == 0


def test_runs_bound_to_a_row_replay_with_it_and_a_deleted_row_is_named():
    from testproject.demo.models import Order

    with time_machine(START) as machine:
        kept, gone = (Order.objects.create(customer=c, total_cents=500) for c in "ab")
        runs = [kept.fulfil.start(), gone.fulfil.start()]
        machine.advance()
        assert {r.state for r in WorkflowRun.objects.filter(pk__in=[r.pk for r in runs])} == {
            "waiting"
        }
        status, report = check("--workflow", runs[0].name)
        assert (status, report["checked"]) == (0, 2)
        Order.objects.filter(pk=gone.pk).delete()
        status, report = check("--workflow", runs[0].name)
        (divergence,) = report["runs"]
        assert status == 1 and divergence["run_id"] == runs[1].pk
        assert divergence["reason"] == "bound_row" and f"pk={gone.pk}" in divergence["message"]
