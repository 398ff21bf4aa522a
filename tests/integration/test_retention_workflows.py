"""Retention of real workflow runs in the in-process worker, and the ``run_id`` promise.

A run id holds while the run's row is kept: ``start(run_id=...)`` returns the finished
run until ``RUN_RETENTION_DAYS`` after it finished; once the worker pruned it (with its
steps), the same id starts a new run.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

import durable
from durable.models import WorkflowRun, WorkflowStep
from tests.integration import workflow_support as support

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)


def _double(x: int) -> int:
    return 2 * x


@durable.workflow
def doubled(ctx, x):
    ctx.sleep(timedelta(hours=1))
    return ctx.step(_double, x)


def test_a_run_id_holds_for_the_run_retention_then_starts_a_new_run(driver):
    run = doubled.start(21, run_id="order-42")
    run = driver.settle(run, "sleeping")
    driver.turn(timedelta(hours=1))
    run = driver.settle(run, "completed")
    assert run.result == 42 and WorkflowStep.objects.filter(run=run).count() == 2
    driver.turn(timedelta(days=30) - timedelta(minutes=1))  # the engine prunes each turn
    again = doubled.start(1, run_id="order-42")
    assert again.state == "completed" and again.result == 42  # the same run, unchanged
    driver.turn(timedelta(minutes=2))  # past RUN_RETENTION_DAYS since it finished
    assert not WorkflowRun.objects.exists() and not WorkflowStep.objects.exists()
    fresh = doubled.start(1, run_id="order-42")
    assert fresh.state == "pending" and fresh.args == [1]
    driver.settle(fresh, "sleeping")
    driver.turn(timedelta(hours=1))
    assert driver.settle(fresh, "completed").result == 2


def test_a_sleeping_run_is_never_pruned(driver):
    run = driver.settle(doubled.start(1), "sleeping")
    WorkflowRun.objects.filter(pk=run.pk).update(state="sleeping")
    driver.engine.chores.prune(driver.clock.now_ms() + 400 * 86_400_000)
    assert driver.state(run) == "sleeping"
