"""Replay rules, without a database: workflows run in memory against a manual clock.

``MemoryRun`` replays the code from the top at every ``resume()``, exactly as the worker
does, and counts how often each step function really ran.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime, timedelta

import pytest

import durable
from durable import Backoff
from durable.exceptions import NonDeterminismError, SignalTimeout, StepFailed, WorkflowError
from durable.testing import ManualClock
from durable.workflows.memory import MemoryRun
from durable.workflows.records import Status

START = 1_900_000_000_000
DAY = 24 * 3600 * 1000
ATTEMPTS: dict[str, int] = {}
VARIANT = {"new": False}


@pytest.fixture
def clock():
    ATTEMPTS.clear()
    VARIANT["new"] = False
    return ManualClock(start_ms=START)


def make_greeting(name: str) -> str:
    return f"hello {name}"


def shout(text: str) -> str:
    return text.upper() + "!"


def flaky(key: str, failures: int) -> int:
    ATTEMPTS[key] = ATTEMPTS.get(key, 0) + 1
    if ATTEMPTS[key] <= failures:
        raise ConnectionError(f"attempt {ATTEMPTS[key]} of {key} failed")
    return ATTEMPTS[key]


@durable.workflow
def greet(ctx, name):
    greeting = ctx.step(make_greeting, name)
    ctx.sleep(timedelta(days=3))
    return ctx.step(shout, greeting)


@durable.workflow(max_attempts=3, backoff=Backoff(base_s=10, max_s=10))
def retrying(ctx, failures):
    try:
        return ctx.step(flaky, "k", failures)
    except StepFailed as exc:
        return f"gave up after {exc.attempts}: {exc.error}"


def test_a_recorded_step_never_runs_again_and_a_sleep_suspends_until_due(clock):
    run = MemoryRun(greet, "ann", clock=clock)
    assert run.resume().state == "suspended"
    assert run.wake_ms == START + 3 * DAY
    assert run.calls == {"make_greeting": 1}
    clock.advance(3 * DAY - 1)
    assert run.resume().state == "suspended", "woke early"
    assert run.calls == {"make_greeting": 1}
    clock.advance(1)
    outcome = run.resume()
    assert (outcome.state, outcome.result) == ("completed", "HELLO ANN!")
    assert run.calls == {"make_greeting": 1, "shout": 1}
    # Replaying the finished history runs nothing at all.
    assert run.resume().result == "HELLO ANN!"
    assert run.calls == {"make_greeting": 1, "shout": 1}
    assert [(r.seq, r.kind, r.name) for r in run.history] == [
        (0, "step", "make_greeting"),
        (1, "sleep", "sleep"),
        (2, "step", "shout"),
    ]


def test_a_failed_step_is_retried_after_a_backoff_through_the_clock(clock):
    run = MemoryRun(retrying, 2, clock=clock)
    assert run.resume().state == "suspended"
    record = run.history[0]
    assert (record.status, record.attempts) == (Status.RETRYING, 1)
    assert "attempt 1 of k failed" in record.error
    assert START + 5_000 <= run.wake_ms <= START + 10_000  # 10 s, jittered to 50-100%
    assert run.resume().state == "suspended"  # not due: the step is not tried
    assert ATTEMPTS["k"] == 1
    clock.advance(10_000)
    assert run.resume().state == "suspended"
    clock.advance(10_000)
    outcome = run.resume()
    assert (outcome.state, outcome.result) == ("completed", 3)
    assert run.history[0].attempts == 3


def test_step_failed_is_raised_into_the_workflow_which_may_catch_it(clock):
    run = MemoryRun(retrying, 99, clock=clock)
    for _ in range(3):
        run.resume()
        clock.advance(10_000)
    outcome = run.resume()
    assert outcome.state == "completed"
    assert outcome.result.startswith("gave up after 3: ConnectionError: attempt 3")
    assert run.history[0].status == Status.FAILED
    run.resume()
    assert ATTEMPTS["k"] == 3, "a failed step replays as failed, it is not tried again"


@durable.workflow(max_attempts=1)
def uncaught(ctx):
    ctx.step(flaky, "u", 5)


def test_an_uncaught_step_failure_fails_the_run(clock):
    outcome = MemoryRun(uncaught, clock=clock).resume()
    assert outcome.state == "failed"
    assert isinstance(outcome.error, StepFailed)
    assert "step 'flaky' (seq 0) failed after 1 attempt(s)" in str(outcome.error)


def not_json():
    return {1, 2}


@durable.workflow
def bad_result(ctx):
    ctx.step(not_json)


def test_a_step_result_that_is_not_json_fails_at_once(clock):
    run = MemoryRun(bad_result, clock=clock)
    outcome = run.resume()
    assert isinstance(outcome.error, StepFailed) and run.calls == {"not_json": 1}
    assert "set is not JSON-serializable" in outcome.error.error


@durable.workflow
def returns_a_set(ctx):
    return {1}


def test_a_workflow_result_that_is_not_json_fails_the_run(clock):
    outcome = MemoryRun(returns_a_set, clock=clock).resume()
    assert outcome.state == "failed" and "not JSON" in str(outcome.error)


@durable.workflow
def approval(ctx):
    first = ctx.wait_for_signal("approve")
    try:
        ctx.wait_for_signal("approve", timeout=timedelta(hours=1))
    except SignalTimeout as exc:
        return {"first": first, "second": "timed out", "seq": exc.seq}
    return {"first": first, "second": "came"}


def test_a_signal_sent_before_the_wait_is_kept(clock):
    run = MemoryRun(approval, clock=clock)
    run.signal("approve", {"by": "ann"})
    assert run.resume().state == "suspended"  # the second wait
    assert run.history[0].result == {"payload": {"by": "ann"}}


def test_a_signal_after_the_wait_wakes_it_and_a_timeout_raises(clock):
    run = MemoryRun(approval, clock=clock)
    assert run.resume().state == "suspended" and run.wake_ms is None
    run.signal("approve", "yes")
    assert run.resume().state == "suspended"
    assert run.wake_ms == START + 3_600_000
    clock.advance(timedelta(hours=1))
    outcome = run.resume()
    assert outcome.result == {"first": "yes", "second": "timed out", "seq": 1}


def test_changed_code_fails_with_non_determinism_naming_seq_recorded_and_found(clock):
    @durable.workflow(name="tests.unit.changing")
    def changing(ctx):
        ctx.step(make_greeting, "a")
        if VARIANT["new"]:
            ctx.step(shout, "b")  # inserted before the sleep by a "deploy"
        ctx.sleep(timedelta(minutes=1))

    run = MemoryRun(changing, clock=clock)
    assert run.resume().state == "suspended"
    VARIANT["new"] = True
    outcome = run.resume()
    error = outcome.error
    assert outcome.state == "failed" and isinstance(error, NonDeterminismError)
    assert (error.seq, error.recorded, error.found) == (1, "sleep sleep", "step shout")
    assert "seq 1" in str(error)
    assert run.calls == {"make_greeting": 1}, "nothing ran past the mismatch"


def test_code_that_stops_before_the_history_ends_is_non_deterministic(clock):
    @durable.workflow(name="tests.unit.shrinking")
    def shrinking(ctx):
        ctx.step(make_greeting, "a")
        if not VARIANT["new"]:
            ctx.step(shout, "b")

    run = MemoryRun(shrinking, clock=clock)
    assert run.resume().state == "completed"
    VARIANT["new"] = True
    error = run.resume().error
    assert isinstance(error, NonDeterminismError) and error.found == "return"


def test_a_swallowed_non_determinism_error_still_fails_the_run(clock):
    @durable.workflow(name="tests.unit.swallowing")
    def swallowing(ctx):
        with contextlib.suppress(NonDeterminismError):
            ctx.step(shout if VARIANT["new"] else make_greeting, "x")
        return "pretend all is well"

    run = MemoryRun(swallowing, clock=clock)
    run.resume()
    VARIANT["new"] = True
    assert isinstance(run.resume().error, NonDeterminismError)


def cleanup():
    return "cleaned"


@durable.workflow
def with_finally(ctx):
    try:
        ctx.sleep(timedelta(seconds=5))
    finally:
        ctx.step(cleanup)  # must not run while the sleep is suspending


@durable.workflow
def swallow_everything(ctx):
    with contextlib.suppress(BaseException):  # the point of the test
        ctx.sleep(timedelta(seconds=5))
    ctx.step(cleanup)
    return "escaped"


def test_nothing_runs_past_a_suspension_point(clock):
    run = MemoryRun(with_finally, clock=clock)
    assert run.resume().state == "suspended" and run.calls == {}
    clock.advance(5_000)
    assert run.resume().state == "completed" and run.calls == {"cleanup": 1}
    sneaky = MemoryRun(swallow_everything, clock=clock)
    assert sneaky.resume().state == "suspended" and sneaky.calls == {}


@durable.workflow
def values(ctx):
    stamp = ctx.now()
    ctx.sleep(timedelta(seconds=1))
    return [stamp.isoformat(), ctx.random(), str(ctx.uuid4()), ctx.idempotency_key]


def test_now_random_and_uuid4_are_recorded_and_identical_on_replay(clock):
    run = MemoryRun(values, clock=clock)
    run.resume()
    clock.advance(60_000)
    first = run.resume().result
    assert first[0] == datetime.fromtimestamp(START / 1000, tz=UTC).isoformat()
    assert 0 <= first[1] < 1 and uuid.UUID(first[2]).version == 4
    assert first[3] == "memory:4"
    clock.advance(60_000)
    assert run.resume().result == first


@durable.workflow(max_attempts=3, backoff=timedelta(seconds=1))
def keyed(ctx):
    return ctx.step(flaky_with_key, ctx.idempotency_key)


def flaky_with_key(key: str) -> str:
    ATTEMPTS[key] = ATTEMPTS.get(key, 0) + 1
    if ATTEMPTS[key] < 2:
        raise RuntimeError("first attempt fails")
    return key


def test_the_idempotency_key_is_stable_across_retries(clock):
    run = MemoryRun(keyed, clock=clock)
    run.resume()
    clock.advance(5_000)
    assert run.resume().result == "memory:0"
    assert ATTEMPTS == {"memory:0": 2}


def old_path():
    return "old"


def new_path():
    return "new"


@durable.workflow
def versioned(ctx):
    ctx.sleep(timedelta(seconds=1))
    if VARIANT["new"] and ctx.patched("use-new-path"):
        return ctx.step(new_path)
    return ctx.step(old_path)


def test_patched_keeps_old_histories_on_the_old_path(clock):
    old = MemoryRun(versioned, clock=clock)
    old.resume()
    clock.advance(1_000)
    assert old.resume().result == "old"  # completed before the change
    VARIANT["new"] = True
    assert old.resume().result == "old"  # its history predates the patch
    new = MemoryRun(versioned, clock=clock)
    new.resume()
    clock.advance(1_000)
    assert new.resume().result == "new"
    assert [r.kind for r in new.history] == ["sleep", "patched", "step"]
    assert new.resume().result == "new"


def test_patched_is_true_for_a_run_that_had_not_reached_the_change(clock):
    sleeping = MemoryRun(versioned, clock=clock)
    sleeping.resume()  # suspended in the sleep when the new code is deployed
    VARIANT["new"] = True
    clock.advance(1_000)
    assert sleeping.resume().result == "new"


def test_options_set_the_recorded_name_and_the_attempts(clock):
    @durable.workflow(name="tests.unit.options")
    def with_options(ctx):
        try:
            ctx.options(max_attempts=1, name="charge-card").step(flaky, "o", 1)
        except StepFailed as exc:
            return exc.name

    run = MemoryRun(with_options, clock=clock)
    assert run.resume().result == "charge-card"
    assert run.history[0].name == "charge-card" and run.history[0].attempts == 1


def test_bad_arguments_to_ctx_calls_are_raised_into_the_workflow(clock):
    @durable.workflow(name="tests.unit.bad_calls")
    def bad_calls(ctx):
        problems = []
        for call in (
            lambda: ctx.sleep(timedelta(seconds=-1)),
            lambda: ctx.sleep(5),
            lambda: ctx.sleep_until(datetime(2030, 1, 1)),
            lambda: ctx.wait_for_signal(""),
            lambda: ctx.wait_for_signal("x", timeout=timedelta(0)),
            lambda: ctx.options(max_attempts=0),
            lambda: ctx.step("not callable"),
        ):
            try:
                call()
            except (TypeError, ValueError) as exc:
                problems.append(str(exc).split(":")[0])
        return problems

    assert MemoryRun(bad_calls, clock=clock).resume().result == [
        "delay",
        "delay",
        "when",
        "name",
        "timeout",
        "max_attempts",
        "ctx.step()",
    ]


def test_children_need_the_database(clock):
    @durable.workflow(name="tests.unit.parent")
    def parent(ctx):
        return ctx.child(greet, "x")

    with pytest.raises(WorkflowError, match="need the database"):
        MemoryRun(parent, clock=clock).resume()
