"""Retention: finished timers, dead letters and finished workflow runs are pruned on time.

Driven by the manual clock: rows older than their setting go, younger ones stay, runs
still going never do, a tree of runs goes whole or not at all, and every call deletes a
bounded batch. Also the promise of keys and run ids: taken while their row is kept, free
once it is pruned.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connections, transaction
from django.test.utils import override_settings

import durable
from durable.conf import find_problems, get_settings
from durable.models import Timer, WorkflowRun, WorkflowSignal, WorkflowStep
from durable.storage import retention
from durable.storage import workflows as wf_store
from durable.storage.leases import ms_to_dt
from durable.worker import housekeeping
from testproject.demo import handlers as h

pytestmark = pytest.mark.django_db
DAY_MS = 86_400_000


def prune(clock) -> int:
    return housekeeping.prune("default", get_settings(), clock.now_ms(), "test-node")


def ago(clock, days: float):
    return ms_to_dt(clock.now_ms() - int(days * DAY_MS))


def make_run(clock, pk: str, state: str = "completed", days: float | None = 31, **fields):
    """A run with two steps and a signal, finished ``days`` ago (None: unfinished)."""
    finished = None if days is None else ago(clock, days)
    run = WorkflowRun.objects.create(
        id=pk, name="wf", shard=0, state=state, finished_at=finished, **fields
    )
    for seq in (0, 1):
        WorkflowStep.objects.create(run=run, seq=seq, kind="step", name="s", status="done")
    WorkflowSignal.objects.create(run=run, name="go", payload=None)
    return run


def run_ids() -> set[str]:
    return set(WorkflowRun.objects.values_list("id", flat=True))


# -- timers ----------------------------------------------------------------------------


def test_failed_timers_go_after_failed_retention_and_younger_ones_stay(clock):
    old, young, pending = (durable.schedule(h.noop) for _ in range(3))
    Timer.objects.filter(pk=old.pk).update(state="failed", updated_at=ago(clock, 30.5))
    Timer.objects.filter(pk=young.pk).update(state="failed", updated_at=ago(clock, 29.5))
    Timer.objects.filter(pk=pending.pk).update(updated_at=ago(clock, 400))
    assert prune(clock) == 1
    assert set(Timer.objects.values_list("pk", flat=True)) == {young.pk, pending.pk}


def test_failed_retention_none_keeps_dead_letters_forever(clock, settings):
    settings.DURABLE = {"FAILED_RETENTION_DAYS": None}
    timer = durable.schedule(h.noop)
    Timer.objects.filter(pk=timer.pk).update(state="failed", updated_at=ago(clock, 36_000))
    assert prune(clock) == 0 and Timer.objects.filter(pk=timer.pk).exists()


def test_failed_timers_are_deleted_in_bounded_batches(clock):
    durable.schedule_many({"fn": h.noop} for _ in range(1_050))
    Timer.objects.update(state="failed", updated_at=ago(clock, 31))
    assert prune(clock) == 1_000
    assert prune(clock) == 50


def test_a_key_holds_until_its_cancelled_row_is_pruned_then_schedules_again(clock):
    first = durable.schedule(h.noop, key="welcome:42")
    assert durable.cancel(first) is True
    clock.advance(timedelta(days=6, hours=23))
    prune(clock)
    again = durable.schedule(h.record, args=["x"], key="welcome:42")
    assert again.pk == first.pk and again.state == "canceled"  # returned unchanged
    clock.advance(timedelta(hours=2))  # now past RETENTION_DAYS (7) since the cancel
    assert prune(clock) == 1
    fresh = durable.schedule(h.record, args=["x"], key="welcome:42")
    assert fresh.pk != first.pk and fresh.state == "pending" and fresh.target.endswith("record")


def test_a_key_of_a_fired_timer_holds_for_the_retention(start_engine, clock):
    engine = start_engine({"SHARDS": 1})
    first = durable.schedule(h.record, args=["once"], key="once")
    clock.advance(1_000)
    engine.runners[0].rescan(clock.now_ms())  # SQLite has no NOTIFY
    engine.tick()
    assert Timer.objects.get(pk=first.pk).state == "fired"
    clock.advance(timedelta(days=7) - timedelta(seconds=1))
    engine.chores.prune(clock.now_ms())
    assert durable.schedule(h.record, args=["once"], key="once").pk == first.pk
    clock.advance(timedelta(seconds=2))
    engine.chores.prune(clock.now_ms())
    assert durable.schedule(h.record, args=["once"], key="once").pk != first.pk


@pytest.mark.parametrize("path", ["by id", "django delete"])
def test_a_pruned_timer_leaves_its_children_without_a_parent(clock, monkeypatch, path):
    """Both ways of deleting: by id (no model of the project points at timers: this test
    project's case), and Django's ``delete()`` (one does, so its ``on_delete`` applies)."""
    assert retention.foreign_keys_to_timers() == []
    if path == "django delete":
        monkeypatch.setattr(retention, "foreign_keys_to_timers", lambda: ["app.Model.timer"])
    parent, child, other = (durable.schedule(h.noop) for _ in range(3))
    Timer.objects.filter(pk=child.pk).update(parent=parent.pk)
    Timer.objects.filter(pk=parent.pk).update(state="fired", updated_at=ago(clock, 8))
    assert prune(clock) == 1
    assert set(Timer.objects.values_list("pk", "parent_id")) == {(child.pk, None), (other.pk, None)}


@pytest.mark.parametrize("path", ["by id", "django delete"])
def test_a_parent_and_child_pruned_in_one_batch_both_go(clock, monkeypatch, path):
    """On PostgreSQL a batch is one statement that clears the children's ``parent`` and
    deletes: a child in the same batch must be deleted, not only unlinked (a statement
    that modifies a row twice keeps one of the two changes)."""
    if path == "django delete":
        monkeypatch.setattr(retention, "foreign_keys_to_timers", lambda: ["app.Model.timer"])
    parent, child, grandchild, other = (durable.schedule(h.noop) for _ in range(4))
    Timer.objects.filter(pk=child.pk).update(parent=parent.pk)
    Timer.objects.filter(pk=grandchild.pk).update(parent=child.pk)
    Timer.objects.filter(pk__in=[parent.pk, child.pk]).update(
        state="fired", updated_at=ago(clock, 8)
    )
    assert prune(clock) == 2
    assert set(Timer.objects.values_list("pk", "parent_id")) == {
        (grandchild.pk, None),
        (other.pk, None),
    }


def test_a_batch_of_fired_timers_is_one_statement_on_postgresql(clock):
    """One round trip per batch on the worker's loop (docs: run-the-worker, Retention)."""
    from django.test.utils import CaptureQueriesContext

    if connections["default"].vendor != "postgresql":
        pytest.skip("the one-statement batch is PostgreSQL's")
    durable.schedule_many({"fn": h.noop} for _ in range(3))
    Timer.objects.update(state="fired", updated_at=ago(clock, 8))
    with CaptureQueriesContext(connections["default"]) as queries:
        assert retention.prune_finished("default", clock.now_ms() - 7 * DAY_MS) == 3
    assert len(queries.captured_queries) == 1, queries.captured_queries


def test_pruning_catches_up_a_batch_at_a_time_between_turns(start_engine, clock, caplog):
    """A pass deletes one batch of fired timers; while batches come back full, the chores
    delete one more every PRUNE_STEP_MS, then fall back to the pass once a minute."""
    from durable.worker import chores, housekeeping

    engine = start_engine({"SHARDS": 1})
    batch, step = housekeeping.TIMER_BATCH, chores.PRUNE_STEP_MS
    durable.schedule_many({"fn": h.noop} for _ in range(2 * batch + batch // 2))
    Timer.objects.update(state="fired", updated_at=ago(clock, 8))
    left = Timer.objects.count
    now = clock.now_ms() + chores.PRUNE_EVERY_MS  # the start-up pass is behind us
    with caplog.at_level(logging.INFO, logger="durable.worker"):
        engine.chores.after_firing(now)
        assert left() == batch + batch // 2  # one batch, no more
        assert engine.chores.next_due_ms() == now + step  # the engine wakes for the next
        engine.chores.after_firing(now + step - 1)
        assert left() == batch + batch // 2  # not yet
        engine.chores.after_firing(now + step)
        assert left() == batch // 2
        engine.chores.after_firing(now + 2 * step)
        assert left() == 0
        empty = 0  # paced batches finding none: each gap twice the last, up to the pass
        while engine.chores.next_due_ms() < now + chores.PRUNE_EVERY_MS:
            engine.chores.after_firing(engine.chores.next_due_ms())
            empty += 1
        assert 1 < empty < 15
        durable.schedule_many({"fn": h.noop} for _ in range(10))
        Timer.objects.update(state="fired", updated_at=ago(clock, 8))
        engine.chores.after_firing(now + chores.PRUNE_EVERY_MS - 1)
        assert left() == 10  # caught up: the next pass, a minute after the last
        assert engine.chores.next_due_ms() == now + chores.PRUNE_EVERY_MS
        engine.chores.after_firing(now + chores.PRUNE_EVERY_MS)
        assert left() == 0
        pruned = [r.getMessage() for r in caplog.records if "timers.pruned" in r.getMessage()]
        # One line, by the pass, for the batches since the last (its own come at the next).
        assert pruned == [f"timers.pruned rows={2 * batch + batch // 2} node=test-node"]


def test_paced_batches_come_back_when_about_the_target_has_passed_retention(start_engine, clock):
    """Caught up, the next batch comes when about PRUNE_TARGET_ROWS rows have passed
    retention at the rate the last batch found them: small batches spread evenly, not a
    burst of full ones once a minute."""
    from durable.worker import chores, housekeeping

    engine = start_engine({"SHARDS": 1})
    batch, step, target = housekeeping.TIMER_BATCH, chores.PRUNE_STEP_MS, chores.PRUNE_TARGET_ROWS
    assert step < target and target % 10 == 0  # what the figures below assume
    left = Timer.objects.count

    def fired_past_retention(n: int) -> None:
        durable.schedule_many({"fn": h.noop} for _ in range(n))
        Timer.objects.update(state="fired", updated_at=ago(clock, 8))

    now = clock.now_ms() + chores.PRUNE_EVERY_MS
    fired_past_retention(batch + target)
    engine.chores.after_firing(now)  # full: the next one a step later
    engine.chores.after_firing(now + step)  # `target` rows in `step` ms: again a step later
    assert left() == 0
    assert engine.chores.next_due_ms() == now + 2 * step
    fired_past_retention(target // 4)  # a quarter of the rate: four steps to the next
    engine.chores.after_firing(now + 2 * step)
    assert left() == 0
    assert engine.chores.next_due_ms() == now + 6 * step
    fired_past_retention(target // 10)  # a tenth of the target in four steps now
    engine.chores.after_firing(now + 6 * step - 1)
    assert left() == target // 10  # not yet
    engine.chores.after_firing(now + 6 * step)
    assert left() == 0
    assert engine.chores.next_due_ms() == now + 6 * step + 40 * step
    engine.chores.after_firing(now + 46 * step)  # none in a gap of 40 steps: look again
    assert engine.chores.next_due_ms() == now + 46 * step + 80 * step  # after twice the gap
    fired_past_retention(10 * batch)  # a surge: at most one batch, then a step
    engine.chores.after_firing(now + 126 * step)
    assert left() == 9 * batch
    assert engine.chores.next_due_ms() == now + 127 * step


def test_a_key_of_a_failed_timer_holds_for_the_failed_retention(clock):
    first = durable.schedule(h.noop, key="dead")
    Timer.objects.filter(pk=first.pk).update(state="failed", updated_at=ago(clock, 8))
    prune(clock)  # past RETENTION_DAYS, not FAILED_RETENTION_DAYS: kept
    assert durable.schedule(h.noop, key="dead").pk == first.pk
    Timer.objects.filter(pk=first.pk).update(updated_at=ago(clock, 31))
    prune(clock)
    assert durable.schedule(h.noop, key="dead").pk != first.pk


# -- workflow runs ---------------------------------------------------------------------


def test_finished_runs_go_with_their_steps_and_signals_after_run_retention(clock, caplog):
    for state in ("completed", "failed", "canceled"):
        make_run(clock, f"old-{state}", state)
    make_run(clock, "young", days=29.5)
    make_run(clock, "running", "running", days=None)
    make_run(clock, "sleeping-old", "sleeping", days=None, updated_at=ago(clock, 400))
    with caplog.at_level(logging.INFO, logger="durable.worker"):
        assert prune(clock) == 3
    assert run_ids() == {"young", "running", "sleeping-old"}
    assert set(WorkflowStep.objects.values_list("run_id", flat=True)) == run_ids()
    assert set(WorkflowSignal.objects.values_list("run_id", flat=True)) == run_ids()
    [record] = [r for r in caplog.records if r.durable["event"] == "runs.pruned"]
    assert record.durable["runs"] == 3


def test_run_retention_none_keeps_finished_runs(clock, settings):
    settings.DURABLE = {"RUN_RETENTION_DAYS": None}
    make_run(clock, "ancient", days=36_000)
    assert prune(clock) == 0 and run_ids() == {"ancient"}


@pytest.mark.parametrize(
    ("child_state", "child_days"),
    [("running", None), ("waiting", None), ("completed", 5), ("failed", 29)],
)
def test_a_tree_waits_for_its_last_run(clock, child_state, child_days):
    make_run(clock, "root", days=60)
    make_run(clock, "done-child", days=60, parent_id="root")
    make_run(clock, "child", child_state, days=child_days, parent_id="root")
    make_run(clock, "grandchild", days=60, parent_id="child")
    assert prune(clock) == 0
    assert run_ids() == {"root", "done-child", "child", "grandchild"}


def test_a_grandchild_still_going_keeps_the_whole_tree(clock):
    make_run(clock, "root", days=60)
    make_run(clock, "child", days=60, parent_id="root")
    make_run(clock, "grandchild", "sleeping", days=None, parent_id="child")
    assert prune(clock) == 0 and len(run_ids()) == 3


def test_a_finished_child_of_an_unfinished_parent_is_kept(clock):
    make_run(clock, "parent", "waiting", days=None)
    make_run(clock, "child", days=60, parent_id="parent")
    assert prune(clock) == 0 and run_ids() == {"parent", "child"}


def test_a_whole_old_tree_goes_children_first(clock):
    make_run(clock, "root", days=60)
    make_run(clock, "a", "failed", days=45, parent_id="root")
    make_run(clock, "b", "canceled", days=31, parent_id="root")
    make_run(clock, "a1", days=50, parent_id="a")
    assert prune(clock) == 4 and run_ids() == set()
    assert not WorkflowStep.objects.exists() and not WorkflowSignal.objects.exists()


def test_a_pending_wake_up_keeps_a_finished_run(clock):
    make_run(clock, "woken", days=60)
    make_run(clock, "quiet", days=60)
    durable.schedule(h.noop, key="wf:quiet:0")  # not a wake-up: another kind
    now = clock.now_ms()
    wf_store.ensure_wake("default", "woken", 0, wf_store.wake_key("woken", 3), now + DAY_MS, now)
    wf_store.ensure_wake("default", "woken2", 0, wf_store.wake_key("woken2", 3), now, now)
    [wake] = Timer.objects.filter(target="woken")
    assert prune(clock) == 1 and run_ids() == {"woken"}
    Timer.objects.filter(pk=wake.pk).update(state="fired", updated_at=ago(clock, 0))
    assert prune(clock) == 1 and run_ids() == set()


def test_runs_are_deleted_in_bounded_batches(clock):
    when = ago(clock, 31)
    WorkflowRun.objects.bulk_create(
        WorkflowRun(id=f"r{i:05d}", name="wf", shard=0, state="completed", finished_at=when)
        for i in range(2_400)
    )
    cutoff = retention.cutoff_ms(clock.now_ms(), 30)
    assert retention.prune_runs("default", cutoff, batch=300) == 300
    assert WorkflowRun.objects.count() == 2_100
    assert prune(clock) == 2_000  # at most 4 batches of 500 a pass
    assert prune(clock) == 100


def test_a_tree_larger_than_the_batch_goes_deepest_first_over_several_calls(clock):
    make_run(clock, "root", days=60)
    for i in range(5):
        make_run(clock, f"c{i}", days=60, parent_id="root")
    cutoff = retention.cutoff_ms(clock.now_ms(), 30)
    assert retention.prune_runs("default", cutoff, batch=3) == 3
    assert "root" in run_ids() and len(run_ids()) == 3
    assert WorkflowRun.objects.filter(parent_id__isnull=True).count() == 1  # none orphaned
    assert retention.prune_runs("default", cutoff, batch=3) == 3
    assert run_ids() == set()


def test_blocked_roots_do_not_hide_prunable_ones_behind_them(clock):
    for i in range(5):  # older, and each waits for a child still running
        make_run(clock, f"busy{i}", days=90)
        make_run(clock, f"busy{i}-child", "running", days=None, parent_id=f"busy{i}")
    make_run(clock, "free", days=40)
    cutoff = retention.cutoff_ms(clock.now_ms(), 30)
    assert retention.prune_runs("default", cutoff, batch=2) == 1
    assert "free" not in run_ids() and len(run_ids()) == 10


# -- settings and status ---------------------------------------------------------------


@pytest.mark.parametrize("key", ["FAILED_RETENTION_DAYS", "RUN_RETENTION_DAYS"])
def test_retention_settings_take_none_or_days(key):
    assert find_problems({key: None}) == [] and find_problems({key: 0}) == []
    for bad in (-1, "30", True, 40_000, float("inf")):
        [problem] = find_problems({key: bad})
        assert problem.id == "durable.E003" and problem.keys == (key,)
        assert "None (keep forever) or a number" in problem.message


def test_durable_status_reports_the_settings_and_rows_past_them(clock, settings):
    settings.DURABLE = {"FAILED_RETENTION_DAYS": None}
    make_run(clock, "old", days=31)
    make_run(clock, "young", days=1)
    timer = durable.schedule(h.noop)
    Timer.objects.filter(pk=timer.pk).update(state="fired", updated_at=ago(clock, 8))
    out = io.StringIO()
    call_command("durable_status", "--json", stdout=out)
    data = {r["setting"]: r for r in json.loads(out.getvalue())["retention"]}
    assert data["RETENTION_DAYS"]["days"] == 7.0 and data["RETENTION_DAYS"]["past"] == 1
    assert data["FAILED_RETENTION_DAYS"]["days"] is None
    assert data["RUN_RETENTION_DAYS"]["days"] == 30.0 and data["RUN_RETENTION_DAYS"]["past"] == 1
    text = io.StringIO()
    call_command("durable_status", stdout=text)
    assert (
        "retention: fired/cancelled timers 7 d (1 past), failed timers forever (0 past), "
        "finished runs 30 d (1 past)"
    ) in text.getvalue()
    with override_settings(DURABLE={}):
        prune(clock)
    out = io.StringIO()
    call_command("durable_status", "--json", stdout=out)
    assert [r["past"] for r in json.loads(out.getvalue())["retention"]] == [0, 0, 0]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_run_locked_elsewhere_keeps_its_tree_without_waiting(clock):
    """Pruning skips rows another transaction holds (a retry, another worker's pruning)."""
    make_run(clock, "root", days=60)
    make_run(clock, "child", days=60, parent_id="root")
    make_run(clock, "other", days=60)
    locked, release = threading.Event(), threading.Event()

    def holder() -> None:
        try:
            with transaction.atomic():
                list(WorkflowRun.objects.select_for_update().filter(pk="child"))
                locked.set()
                release.wait(10)
        finally:
            connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert locked.wait(10)
        cutoff = retention.cutoff_ms(clock.now_ms(), 30)
        assert retention.prune_runs("default", cutoff) == 1  # "other"; no wait on "child"
        assert run_ids() == {"root", "child"}
    finally:
        release.set()
        thread.join(10)
    assert prune(clock) == 2 and run_ids() == set()
