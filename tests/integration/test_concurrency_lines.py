"""The line keeper: a key's line never waits forever for a wake that will not come.

A deploy that removes or raises a limit, or a slot freed without waking anyone (a row
deleted by hand), would leave parked timers with nothing left to end and wake them. The
worker's keeper (:mod:`durable.worker.lines`) wakes them by the limits declared *now*,
at a shard's load and every ``KEEP_EVERY_MS``: these pin both, on a manual clock.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import UTC, datetime

import pytest

import durable
from durable.dispatch.registry import handlers
from durable.limits import ConcurrencyKey
from durable.models import Timer, WorkflowRun
from durable.storage import lines
from durable.storage.concurrency import PARKED_MS
from durable.worker.lines import KEEP_EVERY_MS
from testproject.demo.models import FireRecord
from tests.integration import concurrency_support as support
from tests.integration import workflow_support
from tests.integration.polling import wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]
driver = workflow_support.driver  # fixture


@pytest.fixture
def engine(start_engine):
    support.STARTED.clear()
    support.GATES.clear()
    yield start_engine({"SHARDS": 4, "LEASE_TTL_S": 3600.0, "RESCAN_INTERVAL_S": 1.0}, threads=8)
    for gate in support.GATES.values():
        gate.set()


@pytest.fixture
def redeclare(monkeypatch):
    """``redeclare(**changes)``: ``gated`` as a deploy would change it (this test only)."""

    def change(**changes):
        spec = handlers.get(f"{support.__name__}.gated")
        assert spec is not None and spec.concurrency is not None
        policy = dataclasses.replace(spec.concurrency, **changes) if changes else None
        if policy is not None and policy.max_concurrency is None and policy.rate is None:
            policy = None
        monkeypatch.setitem(
            handlers._specs, spec.name, dataclasses.replace(spec, concurrency=policy)
        )

    return change


def started(count):
    assert wait_for(lambda: len(support.STARTED) >= count), support.STARTED
    time.sleep(0.1)  # and no more than that
    return sorted(support.STARTED)


def firing() -> int:
    return Timer.objects.filter(state="firing").count()


def parked() -> list[int]:
    """``n`` of the ``gated`` calls parked, in line order."""
    rows = Timer.objects.filter(fire_at_ms=PARKED_MS).order_by("queued_ms", "id")
    return [timer.args[1] for timer in rows]


def line_of(engine, clock, count):
    """``count`` calls of account acme, due 1 ms apart: 1 and 2 run, the rest wait."""
    base = clock.now_ms()
    for n in range(1, count + 1):
        durable.schedule(support.gated, args=["acme", n], at=lines_at(base + n))
    clock.advance(1_000)
    engine.tick()
    assert started(2) == [1, 2]
    assert parked() == list(range(3, count + 1))


def lines_at(ms):
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def turns(engine, clock, seconds, step_ms=5_000):
    """Advance the clock ``seconds`` in steps, a turn after each."""
    for _ in range(seconds * 1000 // step_ms):
        clock.advance(step_ms)
        engine.tick()


def test_a_removed_limit_wakes_the_whole_line_within_the_bound(engine, clock, redeclare):
    line_of(engine, clock, 6)
    redeclare(max_concurrency=None)  # the deploy: no limit left
    turns(engine, clock, 30)
    assert parked() == [3, 4, 5, 6], "nothing ended: nothing woke them before the pass"
    turns(engine, clock, KEEP_EVERY_MS // 1000)
    assert started(6) == [1, 2, 3, 4, 5, 6], "the keeper woke the whole line"
    assert parked() == []
    assert firing() == 6, "all at once: there is no limit now"


def test_a_long_line_is_made_due_whole_in_several_transactions(
    engine, clock, redeclare, monkeypatch
):
    monkeypatch.setattr(lines, "UNLIMITED_CHUNK", 2)
    line_of(engine, clock, 7)
    redeclare(max_concurrency=None)
    engine.lines.next_ms = 0
    assert engine.lines.run(engine.runners, clock.now_ms()) == 5
    assert parked() == []
    engine.tick()
    assert started(7) == [1, 2, 3, 4, 5, 6, 7]


def test_a_worker_that_does_not_know_the_handler_leaves_its_line_alone(engine, clock, monkeypatch):
    line_of(engine, clock, 4)
    Timer.objects.filter(state="firing").delete()  # room for both waiting ones
    monkeypatch.delitem(handlers._specs, f"{support.__name__}.gated")  # an older release
    engine.lines.next_ms = 0
    assert engine.lines.run(engine.runners, clock.now_ms()) == 0
    assert parked() == [3, 4]


def test_a_raised_limit_runs_up_to_the_new_limit_never_more(engine, clock, redeclare):
    line_of(engine, clock, 8)
    redeclare(max_concurrency=5)  # the deploy: 2 -> 5
    turns(engine, clock, KEEP_EVERY_MS // 1000)
    assert started(5) == [1, 2, 3, 4, 5], "three more, the heads of the line"
    assert firing() == 5
    assert parked() == [6, 7, 8], "no more than the new limit; their places kept"
    assert ConcurrencyKey.objects.get().max_concurrency == 5, "the ends wake by it now"
    support.GATES.setdefault(1, threading.Event()).set()
    assert wait_for(lambda: 6 in support.STARTED or parked() == [7, 8])
    engine.tick()
    assert started(6) == [1, 2, 3, 4, 5, 6]
    assert firing() == 5


def test_a_new_owner_wakes_by_the_new_limit_in_the_turn_it_loads_the_shard(
    engine, clock, redeclare, start_engine
):
    line_of(engine, clock, 6)
    redeclare(max_concurrency=3)
    # Nothing of the key left running (an operator deleted both rows), then the deploy
    # restarts the workers: the shards' new owner looks at their lines at once.
    Timer.objects.filter(state="firing").delete()
    engine.shutdown(wait_s=0)  # 1 and 2 are still running: left to their threads
    support.STARTED.clear()
    fresh = start_engine(None, node="after-deploy", threads=8)  # runs its first turn
    assert sorted(fresh.runners) == [0, 1, 2, 3]
    assert started(3) == [3, 4, 5], "woken and started in the turn that loaded the shard"
    assert parked() == [6]
    assert firing() == 3


def test_a_slot_freed_without_a_wake_is_found_within_the_bound(engine, clock):
    line_of(engine, clock, 4)
    (running,) = [t for t in Timer.objects.filter(state="firing") if t.args[1] == 1]
    Timer.objects.filter(pk=running.pk).delete()  # an operator deletes the row
    turns(engine, clock, 30)
    assert parked() == [3, 4], "nothing woke the head before the pass"
    turns(engine, clock, KEEP_EVERY_MS // 1000)
    assert started(3) == [1, 2, 3], "the head, alone: 2 still holds the other slot"
    assert parked() == [4]


def test_the_keeper_wakes_no_more_than_the_free_slots(engine, clock, redeclare):
    line_of(engine, clock, 6)

    def keeper_pass():  # a periodic pass now, without the turn's fires after it
        engine.lines.next_ms = 0
        return engine.lines.run(engine.runners, clock.now_ms())

    assert keeper_pass() == 0
    assert parked() == [3, 4, 5, 6], "a full key's line is left as it is"
    redeclare(max_concurrency=3)
    assert keeper_pass() == 1
    assert parked() == [4, 5, 6], "the head alone: one slot is free"
    assert keeper_pass() == 0, "the woken one holds the slot until it starts"
    engine.tick()
    assert started(3) == [1, 2, 3]
    assert parked() == [4, 5, 6]


@durable.handler(concurrency_key="feed", rate_limit="2/m")
def metered(n: int) -> None:
    """Atomic, at most 2 starts a minute: one ``FireRecord`` per call, at its start."""
    fire = durable.current_fire()
    assert fire is not None
    FireRecord.objects.create(key=f"metered:{n}", fired_at_ms=fire.fired_ms)


def metered_starts() -> dict[int, int]:
    rows = FireRecord.objects.filter(key__startswith="metered:")
    return {int(r.key.split(":")[1]): r.fired_at_ms for r in rows}


def test_a_rate_limited_line_whose_woken_head_was_deleted_is_woken_by_the_window(engine, clock):
    base = clock.now_ms()
    for n in range(1, 6):
        durable.schedule(metered, args=[n], at=lines_at(base + n))
    clock.advance(1_000)
    engine.tick()
    assert sorted(metered_starts()) == [1, 2]
    head = Timer.objects.get(target=f"{__name__}.metered", args=[3])
    assert head.fire_at_ms == base + 1_000 + 60_000, "due when the window has room"
    Timer.objects.filter(pk=head.pk).delete()  # by hand: 4 and 5 wait with nobody to wake them
    turns(engine, clock, 30)
    assert sorted(metered_starts()) == [1, 2]
    turns(engine, clock, KEEP_EVERY_MS // 1000)
    starts = metered_starts()
    assert sorted(starts) == [1, 2, 4, 5], "the keeper woke the head when the window had room"
    assert min(starts[4], starts[5]) >= base + 1_000 + 60_000, "never over 2 in a minute"


def test_keys_of_lines_are_found_by_a_skip_scan(engine, clock):
    line_of(engine, clock, 3)
    for account in ("beta", "alpha"):
        for n in (10, 11, 12):
            durable.schedule(support.gated, args=[account, n])
    clock.advance(1_000)  # the rescan finds them
    engine.tick()
    found = lines.parked_keys("default")
    names = [row[0] for row in found]
    assert names == sorted(f"{support.__name__}.gated:{a}" for a in ("acme", "alpha", "beta"))
    assert {(row[2], row[3]) for row in found} == {("handler", f"{support.__name__}.gated")}


# -- workflows ---------------------------------------------------------------------------


def record(key: str) -> str:
    FireRecord.objects.create(key=key, fired_at_ms=0)
    return key


@durable.workflow(concurrency_key="one", max_concurrency=1, max_attempts=1)
def single(ctx, n):
    """Enters, waits for signal ``go``, leaves."""
    ctx.atomic(record, f"enter:{n}")
    ctx.wait_for_signal("go")
    return n


def entered() -> list[int]:
    rows = FireRecord.objects.filter(key__startswith="enter:").order_by("id")
    return [int(key.split(":")[1]) for key in rows.values_list("key", flat=True)]


def test_a_workflow_line_whose_holder_was_deleted_is_woken_within_the_bound(driver):
    runs = []
    for n in (1, 2, 3):
        runs.append(single.start(n))
        driver.clock.advance(10)
    driver.until(lambda: entered() == [1])
    for _ in range(5):
        driver.turn()
    assert entered() == [1] and driver.state(runs[1]) == "pending"
    WorkflowRun.objects.filter(pk=runs[0].pk).delete()  # retention, or a hand in the admin
    for _ in range(30):
        driver.turn()
    assert entered() == [1], "nothing woke the line before the pass"
    driver.until(lambda: entered() == [1, 2], turns=KEEP_EVERY_MS // 1000)
    for _ in range(3):
        driver.turn()
    assert entered() == [1, 2], "one slot: 3 waits behind 2"
    assert driver.state(runs[2]) == "pending"


def test_a_workflow_whose_limit_was_removed_lets_its_whole_line_in(driver, monkeypatch):
    runs = []
    for n in (1, 2, 3):
        runs.append(single.start(n))
        driver.clock.advance(10)
    driver.until(lambda: entered() == [1])
    monkeypatch.setattr(single, "concurrency", None)  # the deploy: no limit left
    driver.until(lambda: sorted(entered()) == [1, 2, 3], turns=KEEP_EVERY_MS // 1000 + 5)
    assert [driver.state(run) for run in runs] == ["waiting"] * 3
