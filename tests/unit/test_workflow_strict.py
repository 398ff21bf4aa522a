"""Strict mode: wall-clock time and randomness raise inside workflow code, and only there."""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
import uuid
from datetime import timedelta
from time import time as imported_time

import pytest
from django.utils import timezone

import durable
from durable.exceptions import NonDeterminismError
from durable.testing import ManualClock
from durable.workflows.guard import StrictGuard
from durable.workflows.memory import MemoryRun

FORBIDDEN = {
    "time.time": time.time,
    "time.time_ns": time.time_ns,
    "from time import time": imported_time,
    "datetime.now": dt.datetime.now,
    "datetime.utcnow": dt.datetime.utcnow,
    "date.today": dt.date.today,
    "timezone.now": timezone.now,
    "random.random": random.random,
    "random.randint": lambda: random.randint(1, 6),
    "random.choice": lambda: random.choice("abc"),
    "uuid.uuid4": uuid.uuid4,
}


def wall_clock_step() -> float:
    return time.time()  # steps are outside the workflow code: allowed


@durable.workflow(strict=True)
def strict_probe(ctx, name):
    try:
        FORBIDDEN[name]()
    except NonDeterminismError as exc:
        return str(exc)
    return "allowed"


@durable.workflow(strict=True)
def strict_but_careful(ctx):
    stamp = ctx.now()
    seeded = random.Random(ctx.random()).randint(1, 6)  # a seeded generator is deterministic
    took = ctx.step(wall_clock_step)
    ctx.sleep(timedelta(seconds=1))
    return [stamp.year, seeded, took > 0, str(ctx.uuid4())[14]]


@durable.workflow
def lenient(ctx):
    return time.time() > 0


@pytest.fixture
def clock():
    return ManualClock(start_ms=1_900_000_000_000)


@pytest.mark.parametrize("name", sorted(FORBIDDEN))
def test_each_forbidden_call_raises_and_fails_the_run_even_if_caught(clock, name):
    outcome = MemoryRun(strict_probe, name, clock=clock).resume()
    assert outcome.state == "failed"
    assert isinstance(outcome.error, NonDeterminismError)
    assert "strict mode" in str(outcome.error) and "use ctx." in str(outcome.error)


def test_ctx_values_steps_and_seeded_generators_are_allowed(clock):
    run = MemoryRun(strict_but_careful, clock=clock)
    assert run.resume().state == "suspended"
    clock.advance(1_000)
    outcome = run.resume()
    assert outcome.state == "completed", outcome.error
    assert outcome.result[0] == 2030 and outcome.result[2] is True and outcome.result[3] == "4"


def test_without_strict_mode_the_code_is_trusted(clock):
    assert MemoryRun(lenient, clock=clock).resume().result is True


def test_the_guard_is_off_outside_workflow_code_and_on_other_threads(clock):
    assert MemoryRun(strict_probe, "time.time", clock=clock).resume().state == "failed"
    assert time.time() > 0  # this thread, after the replay
    seen = []
    errors = []
    guard = StrictGuard(errors.append)
    guard.arm()
    try:
        worker = threading.Thread(target=lambda: seen.append(time.time()))
        worker.start()
        worker.join()
    finally:
        guard.disarm()
    assert seen and not errors, "another thread was affected"
