"""The chaos checker's Celery dispatch invariants catch each broken promise (no broker).

A small hand-made history of dispatch timers (``durable.schedule_celery``) and the
messages the run's consumer logged keeps every promise and passes; each test then breaks
one the way a bug would (a lost message, a second message with another task id, one
with no fault to explain it, an early one, one after a rollback or a cancel) and the
checker must name the invariant and the operation.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from chaos import report
from chaos.celery_check import CELERY_INVARIANTS
from chaos.checker import History, check

KILL = {"kind": "kill", "start_ms": 1500, "end_ms": 1500, "target": "w1"}


def op(name: str, status: str = "committed", **fields: Any) -> dict[str, Any]:
    record = {"kind": "celery", "op": name, "status": status, "t0": 0, "t1": 10, "queue": "q"}
    return {**record, "due_ms": 1000, **fields}


def row(id_: int, name: str, state: str = "fired") -> dict[str, Any]:
    return {
        "id": id_,
        "state": state,
        "target": "testproject.record",
        "args": [name],
        "attempts": 1,
        "max_attempts": 5,
        "fire_at_ms": 1000,
        "key": None,
    }


def message(name: str, at_ms: int, task_id: str) -> dict[str, Any]:
    return {"task_id": task_id, "task": "testproject.record", "op": name, "at_ms": at_ms}


def clean() -> History:
    """Delivered once; delivered twice across a worker kill, same id; rolled back, never
    sent; cancelled, sent only before the cancel committed; in doubt, never sent."""
    return History(
        ops=[
            op("c1", timer_id=11),
            op("c2", timer_id=12),
            op("c3", "rolled_back"),
            op("c4", timer_id=14),
            {"kind": "cancel", "op": "c4", "status": "committed", "t0": 1190, "t1": 1200}
            | {"timer_id": 14, "result": True},
            op("c5", "unknown", error="OperationalError: the server closed the connection"),
        ],
        faults=[KILL],
        timers=[row(11, "c1"), row(12, "c2"), row(14, "c4", "canceled")],
        # c4: a batch published it, then died (the kill) before its commit, leaving the
        # row to the cancel: published before the cancel committed, run just after it.
        deliveries=[
            message("c1", 1100, "durable-11"),
            message("c2", 1050, "durable-12"),
            message("c2", 13_000, "durable-12"),  # re-fired after the kill's lease expired
            message("c4", 1250, "durable-14"),
        ],
        published={11: [1090], 12: [1040, 12_990], 14: [1180]},
        celery={"broker": "amqp://guest:***@127.0.0.1:5672//", "queue": "q", "error": ""},
        end_ms=100_000,
    )


def flagged(history: History) -> dict[str, list[str]]:
    return {name: found for name, found in check(history).violations.items() if found}


def broken(change) -> History:
    history = copy.deepcopy(clean())
    change(history)
    return history


def test_a_history_that_keeps_every_celery_promise_passes_and_each_invariant_looked():
    verdict = check(clean())
    assert verdict.ok, flagged(clean())
    assert [name for name in CELERY_INVARIANTS if verdict.checked[name] == 0] == []
    assert verdict.ops["celery"] == 3 and verdict.ops["celery:rolled_back"] == 1
    assert verdict.celery is not None and verdict.celery["delivered"] == 4


def _drop(name: str):
    return lambda h: h.deliveries.__setitem__(
        slice(None), [d for d in h.deliveries if d["op"] != name]
    )


@pytest.mark.parametrize(
    ("invariant", "change", "name"),
    [
        ("celery_delivered", _drop("c1"), "c1"),  # a committed timer's message lost
        ("celery_delivered", lambda h: h.timers[0].update(state="pending"), "c1"),
        ("celery_delivered", lambda h: h.deliveries.append(message("x9", 2000, "d-1")), "x9"),
        (
            "celery_dup_same_id_at_fault",  # a duplicate with another task id
            lambda h: h.deliveries.append(message("c1", 9000, "durable-99")),
            "c1",
        ),
        (
            "celery_dup_same_id_at_fault",  # the one message with another id
            lambda h: h.deliveries[0].update(task_id="celery-abc"),
            "c1",
        ),
        ("celery_dup_same_id_at_fault", lambda h: h.faults.clear(), "c2"),  # no fault between
        (
            "celery_dup_same_id_at_fault",  # the kill came well before both messages
            lambda h: h.deliveries.__setitem__(
                slice(1, 3), [message("c2", 5000, "durable-12"), message("c2", 6000, "durable-12")]
            ),
            "c2",
        ),
        ("celery_never_early", lambda h: h.deliveries[0].update(at_ms=999), "c1"),
        (
            "celery_rolled_back_unsent",
            lambda h: h.deliveries.append(message("c3", 1100, "durable-13")),
            "c3",
        ),
        ("celery_rolled_back_unsent", lambda h: h.timers.append(row(13, "c3")), "c3"),
        ("celery_cancelled_unsent", lambda h: h.published.clear(), "c4"),  # sent after it
        ("celery_cancelled_unsent", lambda h: h.published.update({14: [1210]}), "c4"),
        ("celery_cancelled_unsent", lambda h: h.timers[2].update(state="fired"), "c4"),
    ],
)
def test_each_broken_celery_promise_is_caught_and_named(invariant, change, name):
    found = flagged(broken(change))
    assert invariant in found, found
    assert any(f"op {name}" in text for text in found[invariant]), found[invariant]


def test_a_commit_in_doubt_may_have_sent_or_not():
    assert check(broken(lambda h: h.deliveries.append(message("c5", 1100, "durable-15")))).ok


def test_the_report_says_whether_the_run_had_a_celery_part_and_what_it_saw():
    line = "celery dispatch: 4 tasks run by the Celery worker on queue q"
    assert line in report.table(check(clean()))
    off = broken(lambda h: setattr(h, "celery", None))
    assert "celery dispatch: off (--no-celery)" in report.table(check(off))
    failed = broken(lambda h: h.celery.update(error="ConnectionResetError: reset"))
    assert "ERROR: ConnectionResetError: reset" in report.table(check(failed))


def test_a_broker_that_does_not_answer_stops_the_run_naming_it(tmp_path):
    from chaos import celery_dispatch
    from chaos.run import parse

    # Port 1 on this machine: nothing listens, the connection is refused at once.
    args = parse(["--celery-broker", "amqp://guest:secret@127.0.0.1:1//"])
    with pytest.raises(SystemExit) as stopped:
        celery_dispatch.Session.open(args, tmp_path, "stamp")
    text = str(stopped.value)
    assert "amqp://guest:***@127.0.0.1:1//" in text and "does not answer" in text
    assert "secret" not in text and "CELERY=0" in text
    assert celery_dispatch.Session.open(parse(["--no-celery"]), tmp_path, "stamp") is None
