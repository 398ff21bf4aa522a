"""Concurrency keys on workflow trees: a child run of its ancestor's key runs in the
ancestor's slot (reentrant), so a parent holding the last slot and waiting for such a
child completes instead of waiting for ever.

The runs of one key share its name only within one workflow (``"workflow:<name>:<key>"``),
so the trees here are a workflow that starts itself, directly or through a workflow
without a key.
"""

from __future__ import annotations

import pytest

import durable
from durable.models import Timer, WorkflowRun
from durable.storage.concurrency import PARKED_MS
from testproject.demo.models import FireRecord
from tests.integration import workflow_support as support

pytestmark = pytest.mark.django_db(transaction=True)
driver = support.driver  # fixture (clock: tests/integration/conftest.py)


def record(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


def by_account(account: str, depth: int, *rest: object) -> str:
    return account


@durable.workflow(concurrency_key=by_account, max_concurrency=1)
def nested(ctx, account, depth):
    """Enters, then starts itself one level down (same key) and waits for it."""
    ctx.atomic(record, f"enter:{account}:{depth}")
    below = ctx.child(nested, account, depth - 1) if depth > 0 else []
    return [depth, *below]


@durable.workflow(concurrency_key=by_account, max_concurrency=1)
def held(ctx, account, depth):
    """As ``nested``; the deepest run waits for signal ``go``."""
    ctx.atomic(record, f"enter:{account}:{depth}")
    if depth == 0:
        return ctx.wait_for_signal("go")
    return ctx.child(held, account, depth - 1)


@durable.workflow
def middle(ctx, account, depth):
    """No key: between two runs of ``through``'s key."""
    return ctx.child(through, account, depth)


@durable.workflow(concurrency_key=by_account, max_concurrency=1)
def through(ctx, account, depth):
    """Reaches its own key again through a run of another workflow (``middle``)."""
    ctx.atomic(record, f"enter:{account}:{depth}")
    return ctx.child(middle, account, depth - 1) if depth > 0 else depth


@durable.workflow(concurrency_key=by_account, max_concurrency=2)
def pair(ctx, account, depth, tag):
    """Two slots: a run of depth 1 starts one child of its key and waits for it."""
    ctx.atomic(record, f"enter:{tag}:{depth}")
    if depth > 0:
        ctx.child(pair, account, depth - 1, tag)
    ctx.atomic(record, f"leave:{tag}:{depth}")
    return tag


@durable.workflow(concurrency_key=by_account, max_concurrency=1, rate_limit="1/m")
def rated(ctx, account, depth):
    """One slot and one start a minute: the child's start waits for the rate, not for ever."""
    ctx.atomic(record, f"enter:{account}:{depth}")
    return ctx.child(rated, account, depth - 1) if depth > 0 else depth


def entered(prefix: str = "enter:") -> list[str]:
    """The ``enter:`` records, in the order they were made."""
    rows = FireRecord.objects.filter(key__startswith=prefix).order_by("id")
    return list(rows.values_list("key", flat=True))


def start_timer(run: WorkflowRun) -> Timer:
    return Timer.objects.get(key=f"wf:{run.pk}:start")


def test_a_child_of_its_parents_key_runs_in_the_parents_slot(driver):
    run = nested.start("acme", 2)
    assert driver.settle(run, "completed", "failed").result == [2, 1, 0]
    assert entered() == ["enter:acme:2", "enter:acme:1", "enter:acme:0"]
    tree = WorkflowRun.objects.filter(concurrency_key=run.concurrency_key)
    assert set(tree.values_list("state", flat=True)) == {"completed"}


def test_another_run_of_the_key_still_waits_for_the_whole_tree(driver):
    run = held.start("acme", 1)
    driver.settle(run, "waiting")  # holds the only slot, waits for its child
    other = held.start("acme", 0)
    driver.clock.advance(10)
    driver.until(lambda: WorkflowRun.objects.filter(parent_id=run.pk, state="waiting").exists())
    for _ in range(3):
        driver.turn()
    assert driver.state(other) == "pending"
    assert start_timer(other).fire_at_ms == PARKED_MS, "in line: the tree holds the slot"
    assert entered() == ["enter:acme:1", "enter:acme:0"]
    (child,) = WorkflowRun.objects.filter(parent_id=run.pk)
    durable.send_signal(child, "go")
    driver.settle(run, "completed")
    driver.settle(other, "waiting")  # the tree's end gave it the slot
    assert entered() == ["enter:acme:1", "enter:acme:0", "enter:acme:0"]
    durable.send_signal(other, "go")
    driver.settle(other, "completed")


def test_a_descendant_through_a_run_without_the_key_runs_in_the_ancestors_slot(driver):
    run = through.start("acme", 2)
    assert driver.settle(run, "completed", "failed").result == 0
    assert entered() == ["enter:acme:2", "enter:acme:1", "enter:acme:0"]


def test_two_slots_two_parents_each_with_a_child_of_the_key(driver):
    first, second = pair.start("acme", 1, "a"), pair.start("acme", 1, "b")
    third = pair.start("acme", 0, "c")  # not of either tree: waits for a free slot
    driver.settle(first, "completed", "failed")
    driver.settle(second, "completed", "failed")
    assert (driver.state(first), driver.state(second)) == ("completed", "completed")
    driver.settle(third, "completed")
    enters = entered()
    assert enters.index("enter:c:0") > max(enters.index("enter:a:1"), enters.index("enter:b:1"))
    leaves = entered("leave:")
    # The third entered after a tree had left: the two trees held both slots until then.
    assert enters.index("enter:c:0") == len(enters) - 1
    assert leaves.index("leave:c:0") > min(leaves.index("leave:a:1"), leaves.index("leave:b:1"))


def test_a_child_over_its_keys_rate_waits_for_the_rate_not_for_ever(driver):
    run = rated.start("acme", 1)
    start_ms = driver.clock.now_ms()
    driver.settle(run, "waiting")
    (child,) = WorkflowRun.objects.filter(parent_id=run.pk)
    driver.turn()
    assert driver.state(child) == "pending"
    parked = start_timer(child)
    assert parked.fire_at_ms < PARKED_MS, "due when the rate has room, not parked"
    assert start_ms + 60_000 <= parked.fire_at_ms <= start_ms + 61_000
    driver.settle(run, "completed", turns=70)
    assert driver.clock.now_ms() >= start_ms + 60_000
    assert entered() == ["enter:acme:1", "enter:acme:0"]
