"""Bad input that only shows in the worker fails its timer, step or run, clearly.

A row whose ``args`` is not a JSON array is dead-lettered without calling its handler;
results past ``DURABLE["MAX_RESULT_BYTES"]`` fail their step, run or task (and reach an
``on_complete`` as None); a run making more ctx calls than
``DURABLE["MAX_STEPS_PER_RUN"]`` fails naming the limit. Driven in-process with a
manual clock, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import timedelta
from typing import Any

import pytest

import durable
from durable.models import Timer, WorkflowRun, WorkflowStep
from testproject.demo import handlers as h
from testproject.demo.models import FireRecord

pytestmark = pytest.mark.django_db(transaction=True)
SETTINGS = {"SHARDS": 4, "LEASE_TTL_S": 3600.0, "RESCAN_INTERVAL_S": 1.0}
BACKEND = "durable.tasks.DurableBackend"


@durable.handler
def touch(key: str) -> None:
    """Record that it was called."""
    FireRecord.objects.create(key=key, fired_at_ms=0)


@durable.handler(atomic=False)
def touch_outside(key: str) -> None:
    """Record that it was called, outside the firing transaction."""
    FireRecord.objects.create(key=key, fired_at_ms=0)


@durable.handler
def big(n: int) -> str:
    """Return ``n`` x's."""
    return "x" * n


def big_step(n: int) -> str:
    return "x" * n


@durable.workflow
def step_too_big(ctx: Any, n: int) -> str:
    """A step whose result is ``n`` bytes of JSON and more."""
    ctx.step(big_step, n)
    return "unreachable"


@durable.workflow
def returns_big(ctx: Any, n: int) -> str:
    """A workflow whose own result is large."""
    return "x" * n


@durable.workflow
def many_calls(ctx: Any, n: int) -> int:
    """Makes ``n`` ctx calls, catching whatever they raise."""
    for _ in range(n):
        with contextlib.suppress(durable.DurableError):
            ctx.now()
    return n


@durable.workflow
def sleeps_forever(ctx: Any) -> str:
    """Sleeps past year 9999, and reports the refusal."""
    try:
        ctx.sleep(timedelta.max)
    except ValueError as exc:
        return str(exc)
    return "slept"


@pytest.fixture
def engine(start_engine, clock):
    def start(**extra: Any):
        return start_engine({**SETTINGS, **extra}, threads=2)

    return start


def turns(engine, clock, n=5, step_ms=1_000):
    for _ in range(n):
        clock.advance(step_ms)
        engine.tick()
        deadline = time.monotonic() + 20
        while engine.firer.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)


def load(engine, clock):
    """SQLite has no NOTIFY: put what was scheduled into the wheels now."""
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())


# -- 7. rows whose args are not a list ---------------------------------------------------


@pytest.mark.parametrize("handler", [touch, touch_outside], ids=["atomic", "external"])
@pytest.mark.parametrize(
    ("column", "value", "words"),
    [
        ("args", "abc", "stored args is a JSON str ('abc'), not an array"),
        ("args", {"key": "k"}, "stored args is a JSON dict"),
        ("kwargs", ["k"], "stored kwargs is a JSON list (['k']), not an object"),
    ],
)
def test_a_row_with_bad_args_is_dead_lettered_without_calling_the_handler(
    engine, clock, handler, column, value, words
):
    worker = engine()
    timer = durable.schedule(handler, args=["k"], max_attempts=5)
    Timer.objects.filter(pk=timer.pk).update(**{column: value})  # as raw SQL could
    good = durable.schedule(handler, args=["good"])
    load(worker, clock)
    turns(worker, clock, n=3)
    row = Timer.objects.get(pk=timer.pk)
    assert (row.state, row.attempts) == ("failed", 1)
    assert words in row.last_error and "the handler was not called" in row.last_error
    assert list(FireRecord.objects.values_list("key", flat=True)) == ["good"]
    assert Timer.objects.get(pk=good.pk).state == "fired"


# -- 8. results past MAX_RESULT_BYTES ------------------------------------------------------


def test_a_step_result_past_the_limit_fails_the_run_naming_step_and_size(engine, clock):
    worker = engine(MAX_RESULT_BYTES=1_000)
    run = step_too_big.start(998)  # 1,000 bytes of JSON with its quotes: fits
    fits = step_too_big.start(999)
    load(worker, clock)
    turns(worker, clock)
    run.refresh_from_db()
    assert run.state == "completed"
    fits.refresh_from_db()
    assert fits.state == "failed"
    assert "step 'big_step'" in fits.error and "failed after 1 attempt(s)" in fits.error
    assert "result: 1001 bytes of JSON; the limit is DURABLE['MAX_RESULT_BYTES'] = 1000" in (
        fits.error
    )
    stored = WorkflowStep.objects.filter(run_id=fits.pk).values_list("result", flat=True)
    assert all(result is None for result in stored)


def test_a_workflow_result_past_the_limit_fails_the_run(engine, clock):
    worker = engine(MAX_RESULT_BYTES=1_000)
    run = returns_big.start(5_000)
    load(worker, clock)
    turns(worker, clock)
    run.refresh_from_db()
    assert run.state == "failed" and run.result is None
    assert "returned a value that is too large: result: 5002 bytes of JSON" in run.error


def test_a_handler_result_past_the_limit_reaches_on_complete_as_none(engine, clock):
    worker = engine(MAX_RESULT_BYTES=1_000)
    small = durable.schedule(big, args=[10], on_complete=h.on_done)
    large = durable.schedule(big, args=[5_000], on_complete=h.on_done)
    load(worker, clock)
    turns(worker, clock, n=4)
    values = {}
    for key in FireRecord.objects.values_list("key", flat=True):
        timer_id, payload = key.split(":", 2)[1:]
        values[int(timer_id)] = json.loads(payload)["result"]
    assert values[small.pk] == {"status": "success", "value": "x" * 10}
    assert values[large.pk] == {"status": "success", "value": None}
    assert Timer.objects.get(pk=large.pk).result is None


def test_a_task_return_value_past_the_limit_fails_the_task(engine, clock, settings):
    worker = engine(MAX_RESULT_BYTES=1_000)
    settings.TASKS = {"default": {"BACKEND": BACKEND, "QUEUES": ["default", "emails"]}}
    from tests.integration import tasks_support

    result = tasks_support.repeat.enqueue(5_000)
    load(worker, clock)
    turns(worker, clock)
    got = tasks_support.repeat.get_result(result.id)
    assert got.status == "FAILED"
    assert "return value: 5002 bytes of JSON" in got.errors[-1].traceback


# -- 9. ctx calls per run ------------------------------------------------------------------


def test_a_run_past_max_steps_per_run_fails_naming_the_limit(engine, clock):
    worker = engine(MAX_STEPS_PER_RUN=5)
    under = many_calls.start(5)
    over = many_calls.start(6)
    load(worker, clock)
    turns(worker, clock)
    under.refresh_from_db()
    over.refresh_from_db()
    assert (under.state, under.result) == ("completed", 5)
    assert over.state == "failed"
    assert "ctx call number 6 exceeds DURABLE['MAX_STEPS_PER_RUN'] = 5" in over.error
    assert WorkflowStep.objects.filter(run_id=over.pk).count() <= 5


# -- 1. a sleep past year 9999 -------------------------------------------------------------


def test_a_sleep_past_the_bound_raises_into_the_workflow(engine, clock):
    worker = engine()
    run = sleeps_forever.start()
    load(worker, clock)
    turns(worker, clock)
    run.refresh_from_db()
    assert run.state == "completed"
    assert run.result.startswith("delay: datetime.timedelta(days=999999999")
    assert "is after 9999-12-30T00:00:00+00:00" in run.result
    assert not WorkflowRun.objects.filter(state="sleeping").exists()


# -- 5. a stored backoff out of bounds (a row from before the bounds) -------------------------


@durable.handler
def fails(key: str) -> None:
    """Always fails."""
    raise RuntimeError(f"{key} failed")


def test_a_stored_backoff_out_of_bounds_does_not_crash_the_worker(engine, clock):
    worker = engine()
    timer = durable.schedule(fails, args=["k"], max_attempts=5)
    Timer.objects.filter(pk=timer.pk).update(backoff_base_s=1e17, backoff_max_s=1e17)
    good = durable.schedule(touch, args=["good"])
    load(worker, clock)
    turns(worker, clock, n=3)
    row = Timer.objects.get(pk=timer.pk)
    # Its retry time cannot be computed: it is dead-lettered with an error that says why,
    # instead of "bigint out of range" retried for ever; its neighbours fire.
    assert (row.state, row.attempts) == ("failed", 1)
    assert "backoff base_s must be > 0 and <= 31,536,000 s (365 days), got 1e+17" in (
        row.last_error
    )
    assert Timer.objects.get(pk=good.pk).state == "fired"
