"""Failing for good: ``durable.GiveUp``, ``retry_on`` and ``give_up_on`` (SQLite, PostgreSQL).

A final failure dead-letters its timer at once: state ``failed`` with one attempt used
of five, the error stored (paths stripped), the ``on_complete`` follow-up told, and the
worker goes on with its other work. Steps fail with ``StepFailed`` after one attempt;
Django tasks are ``FAILED`` after one.
"""

from __future__ import annotations

import logging
import time

import pytest

import durable
from durable.dispatch.giveup import check_exceptions, final, gives_up
from durable.exceptions import GiveUp, HandlerAborted, HandlerTimeout, StepFailed
from durable.models import Timer, TimerState, WorkflowStep
from testproject.demo.models import FireRecord
from tests.integration import give_up_support as h
from tests.integration import workflow_support as support

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)


@pytest.fixture(autouse=True)
def _reset():
    h.CALLS.clear()
    h.FOLLOWUPS.clear()


@pytest.fixture
def engine(start_engine):
    return start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0})


def turns(engine, clock, n=8, step_ms=1_000):
    for _ in range(n):
        clock.advance(step_ms)
        engine.tick()
        deadline = time.monotonic() + 10
        while engine.firer.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)


def row(timer):
    return Timer.objects.get(pk=timer.pk)


def keys():
    return sorted(FireRecord.objects.values_list("key", flat=True))


# -- handlers -------------------------------------------------------------------------


def test_an_atomic_handler_that_gives_up_is_dead_lettered_at_once(engine, clock, caplog):
    bad = durable.schedule(h.declines, args=["pay-1"], on_complete=h.followup)
    good = durable.schedule(h.record, args=["neighbour"])
    with caplog.at_level(logging.ERROR, logger="durable.worker"):
        turns(engine, clock)
    [dead] = [
        r.durable
        for r in caplog.records
        if getattr(r, "durable", {}).get("event") == "timer.dead_letter"
    ]
    assert (dead["timer"], dead["attempts"], dead["gave_up"]) == (bad.pk, 1, True)
    got = row(bad)
    assert got.state == TimerState.FAILED
    assert (got.attempts, got.max_attempts) == (1, 5)
    assert got.last_error == "GiveUp: card declined for pay-1 (see payments.py)"
    assert h.CALLS["pay-1"] == 1  # never retried
    assert row(good).state == TimerState.FIRED
    assert keys() == ["neighbour"]  # the give-up's own write rolled back
    told = {"timer_id": bad.pk, "status": "failed", "error": got.last_error}
    assert list(h.FOLLOWUPS) == [told]


def test_an_external_handler_that_gives_up_is_dead_lettered_at_once(engine, clock):
    bad = durable.schedule(h.declines_outside, args=["acct-9"])
    turns(engine, clock)
    got = row(bad)
    assert (got.state, got.attempts) == (TimerState.FAILED, 1)
    assert got.last_error == "GiveUp: ValueError: no such account acct-9"
    assert h.CALLS["acct-9"] == 1
    after = durable.schedule(h.record, args=["later"])  # the worker goes on
    turns(engine, clock, n=3)
    assert row(after).state == TimerState.FIRED


@pytest.mark.parametrize("error", ["KeyError", "ValueError"])
def test_give_up_on_dead_letters_a_matching_exception_with_its_own_error(engine, clock, error):
    bad = durable.schedule(h.gives_up_on, args=["g", error])
    turns(engine, clock)
    got = row(bad)
    assert (got.state, got.attempts) == (TimerState.FAILED, 1)
    assert got.last_error.startswith(f"{error}: ")
    assert "/srv/" not in got.last_error and "handlers.py" in got.last_error
    assert h.CALLS["g"] == 1


def test_give_up_on_retries_what_it_does_not_name(engine, clock):
    bad = durable.schedule(h.gives_up_on, args=["c", "ConnectionError"])
    turns(engine, clock, n=4)
    assert h.CALLS["c"] >= 2
    assert row(bad).state == TimerState.PENDING  # retrying with backoff


def test_retry_on_retries_a_matching_exception(engine, clock):
    timer = durable.schedule(h.retries_on, args=["r", "ConnectionError"])
    turns(engine, clock, n=15)
    got = row(timer)
    assert (got.state, got.attempts) == (TimerState.FIRED, 3)


def test_retry_on_gives_up_on_any_other_exception(engine, clock):
    timer = durable.schedule(h.retries_on, args=["v", "ValueError"])
    turns(engine, clock)
    got = row(timer)
    assert (got.state, got.attempts) == (TimerState.FAILED, 1)
    assert got.last_error == "ValueError: v failed"
    assert h.CALLS["v"] == 1


# -- the policy and its validation ----------------------------------------------------


def test_the_policy_and_its_precedence():
    assert gives_up(GiveUp("no"), (Exception,), ())  # GiveUp beats retry_on
    assert gives_up(FileNotFoundError(), (OSError,), (FileNotFoundError,))  # give_up_on wins
    assert not gives_up(ConnectionError(), (OSError,), (FileNotFoundError,))
    assert gives_up(ValueError(), (OSError,), ())
    assert not gives_up(ValueError(), (), ())
    # durable's own verdicts are retried unless give_up_on names them
    assert not gives_up(HandlerTimeout("slow"), (OSError,), ())
    assert not gives_up(HandlerAborted("exit"), (OSError,), ())
    assert gives_up(HandlerTimeout("slow"), (), (HandlerTimeout,))
    wrapped = final(KeyError("k"), (), (KeyError,))
    assert isinstance(wrapped, GiveUp) and isinstance(wrapped.cause, KeyError)
    plain = ValueError("v")
    assert final(plain, (), ()) is plain


def test_give_up_keeps_its_cause():
    cause = ValueError("bad")
    exc = GiveUp(cause=cause)
    assert str(exc) == "ValueError: bad" and exc.cause is cause and exc.__cause__ is cause
    assert str(GiveUp()) == GiveUp.__doc__.splitlines()[0]
    assert isinstance(exc, durable.DurableError)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"retry_on": ()}, ValueError, "retry_on: expected at least one"),
        ({"retry_on": "ValueError"}, TypeError, "retry_on: expected Exception subclasses"),
        ({"give_up_on": (KeyError, 3)}, TypeError, "give_up_on: expected Exception subclasses"),
        ({"give_up_on": KeyboardInterrupt}, TypeError, "got KeyboardInterrupt"),
    ],
)
def test_bad_policies_are_rejected_at_decoration(kwargs, error, message):
    with pytest.raises(error, match=message):
        durable.handler(**kwargs)


def test_check_exceptions_accepts_a_class_or_a_sequence():
    assert check_exceptions(None, "retry_on") == ()
    assert check_exceptions(KeyError, "retry_on") == (KeyError,)
    assert check_exceptions([KeyError, OSError], "retry_on") == (KeyError, OSError)


# -- workflow steps -------------------------------------------------------------------


def refuse(key: str) -> None:
    h.CALLS[key] += 1
    raise durable.GiveUp(f"{key} refused")


def lookup(key: str, error: str) -> str:
    h.CALLS[key] += 1
    if h.CALLS[key] < 3:
        raise {"KeyError": KeyError, "ConnectionError": ConnectionError}[error](key)
    return "found"


@durable.workflow(max_attempts=5)
def gives_up_in_a_step(ctx, key):
    return ctx.step(refuse, key)


@durable.workflow(max_attempts=5)
def catches_a_final_step(ctx, key, error):
    try:
        return ctx.options(give_up_on=KeyError).step(lookup, key, error)
    except StepFailed as exc:
        return {"failed": exc.name, "attempts": exc.attempts, "error": exc.error}


@durable.workflow(max_attempts=5)
def retries_only_some(ctx, key, error):
    try:
        return ctx.options(retry_on=(ConnectionError,)).atomic(lookup, key, error)
    except StepFailed as exc:
        return {"attempts": exc.attempts}


def test_a_step_that_gives_up_fails_the_run_after_one_attempt(driver):
    run = gives_up_in_a_step.start("s1")
    run = driver.settle(run, "failed")
    assert h.CALLS["s1"] == 1
    step = WorkflowStep.objects.get(run=run, seq=0)
    assert (step.status, step.attempts, step.error) == ("failed", 1, "GiveUp: s1 refused")
    assert "after 1 attempt(s)" in run.error


def test_give_up_on_reaches_the_workflow_code_as_step_failed(driver):
    run = driver.settle(catches_a_final_step.start("s2", "KeyError"), "completed")
    assert run.result == {"failed": "lookup", "attempts": 1, "error": "KeyError: 's2'"}
    assert h.CALLS["s2"] == 1


def test_a_step_retries_what_give_up_on_does_not_name(driver):
    run = driver.settle(catches_a_final_step.start("s3", "ConnectionError"), "completed")
    assert run.result == "found" and h.CALLS["s3"] == 3


def test_retry_on_in_an_atomic_step(driver):
    run = driver.settle(retries_only_some.start("s4", "KeyError"), "completed")
    assert run.result == {"attempts": 1} and h.CALLS["s4"] == 1
    run = driver.settle(retries_only_some.start("s5", "ConnectionError"), "completed")
    assert run.result == "found" and h.CALLS["s5"] == 3


def test_bad_step_policies_are_rejected_at_the_call():
    from durable.workflows.calls import StepOptions

    with pytest.raises(TypeError, match="retry_on: expected Exception subclasses"):
        StepOptions.checked(None, None, None, None, 60.0, None, ([1], None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give_up_on: expected at least one"):
        StepOptions.checked(None, None, None, None, 60.0, None, (None, ()))  # type: ignore[arg-type]


def test_a_memory_run_gives_up_as_the_worker_does():
    from durable.testing import ManualClock
    from durable.workflows.memory import MemoryRun

    run = MemoryRun(gives_up_in_a_step, "m1", clock=ManualClock(start_ms=0))
    outcome = run.resume()
    assert outcome.state == "failed" and isinstance(outcome.error, StepFailed)
    assert run.history[0].attempts == 1 and h.CALLS["m1"] == 1
    run = MemoryRun(catches_a_final_step, "m2", "KeyError", clock=ManualClock(start_ms=0))
    assert run.resume().result == {"failed": "lookup", "attempts": 1, "error": "KeyError: 'm2'"}


# -- Django tasks ---------------------------------------------------------------------


def test_a_task_that_gives_up_fails_without_retry(engine, clock, settings):
    from durable.tasks import TaskResultStatus

    settings.TASKS = {
        "default": {"BACKEND": "durable.tasks.DurableBackend", "OPTIONS": {"MAX_ATTEMPTS": 3}}
    }
    from tests.integration import give_up_tasks

    result = give_up_tasks.refuses.enqueue("t1")
    turns(engine, clock)
    got = give_up_tasks.refuses.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED
    assert got.attempts == 1
    assert [e.exception_class for e in got.errors] == [GiveUp]
    assert keys() == ["t1"]
    timer = Timer.objects.get(pk=int(result.id))
    assert (timer.state, timer.attempts, timer.max_attempts) == (TimerState.FAILED, 1, 3)
