"""Failure modes users of other job systems report, proven absent on real workers.

- ``cancel()`` racing the fire: True means the effect never happened and ``on_complete``
  saw ``canceled``; False means it fired. The same for ``cancel_workflow()`` against a
  run's final checkpoint. (Peers: a revoked task that runs anyway; a cancelled job whose
  result is still written.)
- An atomic handler that overstays ``LEASE_TTL_S`` while a peer is live commits once, and
  the other shards' lateness stays bounded. (Peers: a visibility timeout or a stalled-job
  sweep hands a long job to a second worker, which runs it again.)
- SIGTERM with 10,000 sleeping runs and 50 outside handlers in flight: exit within the
  grace period plus one batch, leases released, a peer fires everything without waiting
  for the TTL. (Peers: a restart that strands work until a timeout.)
- SIGKILL ~100 ms after a cron occurrence commits, then a restart: that occurrence ran
  once. (Peers: a beat that forgets its last run and fires it again after a crash.)

Each test prints its figures (``pytest -s``) and keeps them in the JUnit report.
"""

from __future__ import annotations

import copy
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connections, transaction

import durable
from durable.conf import get_settings
from durable.core.sharding import bucket_of, shard_for
from durable.models import CronSchedule, ShardLease, Timer, WorkflowRun, WorkflowStep
from durable.scheduling import schedules
from durable.storage.timers import announce, insert_many
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.acceptance import handlers, workflows
from tests.acceptance.helpers import (
    BATCH_TIME_BUDGET_S,
    LEASE_TTL_S,
    SHARDS,
    WorkerPool,
    metric,
    now_ms,
    owned_by,
)

pytestmark = [pytest.mark.acceptance, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def share_evenly(
    workers: WorkerPool, *names: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> None:
    """Start ``names`` (with ``args`` and ``env``); wait until they share the shards equally."""
    for name in names:
        workers.start(name, *args, env=env)
    workers.wait_until(
        lambda: [len(owned_by(n)) for n in names] == [SHARDS // len(names)] * len(names),
        timeout_s=40,
        what=f"{', '.join(names)} sharing the shards evenly",
        require_alive=names,
    )


def key_in(shards: set[int], prefix: str, count: int) -> list[str]:
    """``count`` idempotency keys that route to ``shards``."""
    keys = (f"{prefix}-{i}" for i in range(1_000_000))
    picked = (k for k in keys if shard_for(k, SHARDS) in shards)
    return [next(picked) for _ in range(count)]


def records(prefix: str) -> Counter[str]:
    """FireRecord rows per key, for keys starting with ``prefix``."""
    keys = FireRecord.objects.filter(key__startswith=prefix).values_list("key", flat=True)
    return Counter(keys)


# -- cancel() racing the fire --------------------------------------------------------------


def cancel_all(items: list[tuple[str, object, str]], start_ms: int, threads: int) -> dict:
    """Cancel ``items`` (kind, timer id or run id, key) from ``threads`` threads, each in
    its own shuffled order, starting at ``start_ms``; return key → (result, call ms,
    wall-clock ms after it returned)."""
    results: dict[str, tuple[bool, int, int]] = {}
    shuffled = random.Random(19).sample(items, len(items))

    def worker(part: list[tuple[str, object, str]]) -> None:
        try:
            time.sleep(max(0.0, (start_ms - now_ms()) / 1000))
            for kind, target, key in part:
                began = time.monotonic()
                if kind == "timer":
                    done = durable.cancel(target)
                else:
                    done = durable.cancel_workflow(target)
                results[key] = (done, int((time.monotonic() - began) * 1000), now_ms() + 1)
        finally:
            connections.close_all()

    pool = [threading.Thread(target=worker, args=(shuffled[i::threads],)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(60)
    return results


def test_cancel_racing_the_fire_is_all_or_nothing(workers, record_property):
    """Two workers; 800 timers (half atomic, half outside) and 200 runs whose last call,
    a ``ctx.atomic`` step, follows a sleep, all due at one instant; four threads cancel
    all of them from 40 ms before it on."""
    share_evenly(workers, "w1", "w2")
    due = now_ms() + 4_000
    runs = workflows.sleep_until_then_record.start_many(
        {"args": [f"run-{i}", due]} for i in range(200)
    )
    timers = durable.schedule_many(
        {
            "fn": probes.record if i % 2 else probes.record_external,
            "args": [f"tmr-{i}"],
            "at": at(due),
            "on_complete": probes.outcome,
            "context": f"tmr-{i}",
        }
        for i in range(800)
    )
    workers.wait_until(
        lambda: WorkflowRun.objects.filter(state="sleeping").count() == len(runs),
        timeout_s=max(0.1, (due - now_ms() - 300) / 1000),
        what="every run asleep before the instant",
        require_alive=["w1", "w2"],
    )
    items = [("timer", t.pk, f"tmr-{i}") for i, t in enumerate(timers)]
    items += [("run", r.pk, f"run-{i}") for i, r in enumerate(runs)]
    results = cancel_all(items, due - 40, threads=4)
    assert len(results) == len(items)
    workers.wait_until(
        lambda: (
            not Timer.objects.filter(state__in=["pending", "firing"]).exists()
            and not WorkflowRun.objects.exclude(state__in=["completed", "canceled"]).exists()
        ),
        timeout_s=60,
        what="every timer, follow-up and run finished",
        require_alive=["w1", "w2"],
    )

    effects, outcomes = records("tmr-") + records("run-"), records("outcome:")
    state = dict(Timer.objects.filter(pk__in=[t.pk for t in timers]).values_list("id", "state"))
    state |= dict(
        WorkflowRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("id", "state")
    )
    recorded = Counter(
        WorkflowStep.objects.filter(
            run_id__in=[r.pk for r in runs], kind="atomic", status="done"
        ).values_list("run_id", flat=True)
    )

    def happened(kind: str, target: object, key: str) -> tuple[object, ...]:
        """Timers: (row state, effect rows, on_complete statuses seen); runs: (row state,
        effect rows, recorded atomic steps)."""
        if kind == "run":
            return (state[target], effects[key], recorded[target])
        statuses = {s: n for s in ("canceled", "success") if (n := outcomes[f"outcome:{key}:{s}"])}
        return (state[target], effects[key], statuses)

    def promised(kind: str, cancelled: bool) -> list[tuple[object, ...]]:
        """What cancel()'s answer allows. A timer: True, nothing ran; False, it ran once.
        A run: False, it completed with its row once. True, it is cancelled, and its
        ``ctx.atomic`` row is there only with the step's record: the step may have
        committed just before the cancel (its own checkpoint, before the run's end), and
        the replay stopped at the next one."""
        if kind == "timer":
            return (
                [("canceled", 0, {"canceled": 1})] if cancelled else [("fired", 1, {"success": 1})]
            )
        return [("canceled", 0, 0), ("canceled", 1, 1)] if cancelled else [("completed", 1, 1)]

    wrong = [
        (key, results[key][0], happened(kind, target, key))
        for kind, target, key in items
        if happened(kind, target, key) not in promised(kind, results[key][0])
    ]
    assert not wrong, (
        f"{len(wrong)} disagree (key, cancel(), (state, effects, outcomes or steps)): {wrong[:10]}"
    )
    for kind in ("timer", "run"):
        said = Counter(results[key][0] for k, _, key in items if k == kind)
        metric(record_property, f"{kind}_cancel_true", said[True])
        metric(record_property, f"{kind}_cancel_false", said[False])
        assert said[True] and said[False], f"no race for {kind}s: {said}"
    between = [
        key
        for kind, target, key in items
        if kind == "run" and results[key][0] and happened(kind, target, key)[1] == 1
    ]
    metric(record_property, "run_cancelled_after_its_step", len(between))
    # Those steps committed before the cancel did: each ended (its clock read before its
    # commit) before the cancel returned (after its commit) on this machine's clock.
    ended = {
        run_id: int(started.timestamp() * 1000) + duration
        for run_id, started, duration in WorkflowStep.objects.filter(
            run_id__in=[t for k, t, key in items if key in between], kind="atomic"
        ).values_list("run_id", "started_at", "duration_ms")
    }
    late = [(key, ended[t], results[key][2]) for k, t, key in items
            if key in between and ended[t] > results[key][2]]  # fmt: skip
    assert not late, f"a step committed after its run's cancel (key, step end, cancel end): {late}"
    waited = sorted(ms for _, ms, _ in results.values())
    metric(record_property, "cancel_ms_p50", waited[len(waited) // 2])
    metric(record_property, "cancel_ms_max", waited[-1])


# -- an atomic handler that overstays its lease -----------------------------------------------

SHORT_TTL_S = 2.0  # a stall past the TTL costs seconds, not tens (the checks want the
# batch budget and the rescan interval below the TTL)
SHORT_TTL = {
    "DURABLE_LEASE_TTL_S": str(SHORT_TTL_S),
    "DURABLE_BATCH_TIME_BUDGET_S": "1",
    "DURABLE_RESCAN_INTERVAL_S": "1",
}


@pytest.mark.parametrize(
    "overstay_s", [1.5 * SHORT_TTL_S, 3.5 * SHORT_TTL_S], ids=["commits-late", "aborted-rerun"]
)
def test_an_atomic_handler_past_the_lease_ttl_commits_once(
    workers, record_property, tmp_path, overstay_s
):
    """Its shard's lease row stays locked by the open batch, so the live peer cannot take
    that shard while the handler runs: the handler's own commit lands (``commits-late``),
    or PostgreSQL ends the transaction idle for twice the TTL (5 s at least), the peer
    takes the shard and re-runs it once (``aborted-rerun``). The stalled worker's other
    shards move to the peer when their leases lapse."""
    share_evenly(workers, "a", "b", env=SHORT_TTL)
    shard = owned_by("a")[0]
    token = ShardLease.objects.get(shard=shard).token
    marker = tmp_path / "overstaying"
    timer = durable.schedule(
        handlers.overstay,
        args=["long", str(marker), overstay_s],
        key=key_in({shard}, "long", 1)[0],
    )
    workers.wait_until(marker.exists, timeout_s=15, what="the long handler starting in a")
    began = now_ms()
    # Every other shard gets a timer due every 100 ms while a is stuck, and a while after.
    others = key_in(set(range(SHARDS)) - {shard}, "other", int(overstay_s * 10) + 30)
    durable.schedule_many(
        {"fn": probes.record, "args": [key], "key": key, "at": at(began + 100 * i)}
        for i, key in enumerate(others)
    )
    workers.wait_until(
        lambda: (
            sum(records("other").values()) >= len(others)
            and Timer.objects.filter(pk=timer.pk, state="fired").exists()
        ),
        timeout_s=overstay_s + 20,
        what="the long timer and every other timer fired",
        require_alive=["b"],
        explain=lambda: Timer.objects.filter(pk=timer.pk).values().first(),
    )
    row = Timer.objects.get(pk=timer.pk)
    assert records("long") == {"long": 1}, workers.logs()
    if overstay_s < max(5, 2 * SHORT_TTL_S):  # the idle-in-transaction guard (housekeeping)
        assert (row.fired_token, row.attempts) == (token, 1), "a's own commit landed"
    else:
        assert row.fired_token > token and row.attempts == 2, "b re-ran what a never committed"
    late = sorted(
        fired - due
        for fired, due in FireRecord.objects.filter(key__startswith="other").values_list(
            "fired_at_ms", "due_at_ms"
        )
    )
    assert max(records("other").values()) == 1 and late[0] >= 0
    metric(record_property, "other_shards_lateness_p50_ms", late[len(late) // 2])
    metric(record_property, "other_shards_lateness_max_ms", late[-1])
    # A lapsed lease is taken at its expiry; what a held was due at most a TTL before.
    assert late[-1] <= (SHORT_TTL_S + 2) * 1000, late[-10:]


# -- SIGTERM with a full wheel and handlers in flight -------------------------------------------

GRACE_S = 2.0


def clone_asleep(model: WorkflowRun, count: int) -> Callable[[int], None]:
    """``count`` copies of the sleeping run ``model``: rows now, wake-ups when told.

    10,000 first replays would take the workers most of a minute on a loaded 2-core
    machine, and what the test is about starts once the runs sleep. Each copy is the
    model's rows (run and records) under a new id, written now; the function returned
    writes their wake-ups due at the instant it is given (the copies' sleep records say
    the same instant: a copy is the model as if replayed at another time) and, on
    commit, tells the owning workers to rescan those shards, as ``start_many`` does.
    """
    steps = list(WorkflowStep.objects.filter(run=model))
    wake = Timer.objects.get(target=model.pk, state="pending")
    runs, records_ = [], []
    for _ in range(count):
        run = copy.copy(model)
        run.pk = uuid.uuid4().hex
        run.shard = shard_for(run.pk, SHARDS)
        runs.append(run)
        for step in steps:
            records_.append(copy.copy(step))
            records_[-1].pk, records_[-1].run_id = None, run.pk
    WorkflowRun.objects.bulk_create(runs, batch_size=2_000)
    WorkflowStep.objects.bulk_create(records_, batch_size=2_000)

    def wake_at(ms: int) -> None:
        wakes = []
        for run in runs:
            timer = copy.copy(wake)
            timer.pk, timer.shard, timer.target = None, run.shard, run.pk
            timer.key = wake.key.replace(model.pk, run.pk)
            timer.fire_at_ms, timer.bucket = ms, bucket_of(ms, get_settings().BUCKET_SHIFT)
            wakes.append(timer)
        with transaction.atomic():
            ids = [run.pk for run in runs]
            WorkflowStep.objects.filter(run_id__in=ids, wake_ms__isnull=False).update(
                wake_ms=ms, result=ms
            )
            insert_many("default", wakes)
            announce("default", wakes, now_ms(), per_shard=True)

    return wake_at


def test_sigterm_with_10000_sleeping_runs_and_50_handlers_in_flight(workers, record_property):
    """a holds about half of 10,000 sleeping runs, whose wake-ups come due while it shuts
    down, and 50 outside handlers that outlast its grace period."""
    share_evenly(
        workers, "a", "b", args=("--threads", "50"), env={"DURABLE_SHUTDOWN_GRACE_S": str(GRACE_S)}
    )
    model = workflows.nap.start(3_600)
    workers.wait_until(
        lambda: WorkflowRun.objects.filter(pk=model.pk, state="sleeping").exists(),
        timeout_s=10,
        what="the model run asleep",
    )
    started = time.monotonic()
    wake_at = clone_asleep(model, 10_000)
    Timer.objects.filter(target=model.pk, state="pending").delete()  # its copies replace it
    WorkflowRun.objects.filter(pk=model.pk).delete()
    metric(record_property, "clone_s", round(time.monotonic() - started, 2))
    a_shards = set(owned_by("a"))
    keys = key_in(a_shards, "inflight", 50)
    for key in keys:
        durable.schedule(handlers.linger_first, args=[key, 60], key=key)
    workers.wait_until(
        lambda: Timer.objects.filter(key__in=keys, state="firing").count() == 50,
        timeout_s=10,
        what="50 outside handlers running in a",
    )
    wake = now_ms() + 3_000
    wake_at(wake)
    metric(record_property, "wake_in_ms_after_commit", wake - now_ms())
    on_a = WorkflowRun.objects.filter(shard__in=a_shards).count()
    workers.workers["a"].send(signal.SIGTERM)
    term = time.monotonic()
    workers.workers["a"].proc.wait(timeout=GRACE_S + 20)
    exited = time.monotonic() - term
    metric(record_property, "sigterm_exit_s", round(exited, 2))
    assert exited <= GRACE_S + BATCH_TIME_BUDGET_S + 1, workers.logs()
    assert workers.workers["a"].proc.returncode == 0 and owned_by("a") == [], workers.logs()
    assert records("inflight") == {}, "a's handlers outlasted the grace period"

    took = workers.wait_until(
        lambda: len(owned_by("b")) == SHARDS,
        timeout_s=LEASE_TTL_S - 1,
        what="b taking a's shards before any lease TTL",
        require_alive=["b"],
    )
    metric(record_property, "takeover_after_exit_s", round(took, 2))

    # Claims belong to their lease token: b released a's 50 claims to run again the
    # moment it loaded those shards, not at their claim timeout (CLAIM_TIMEOUT_S).
    def reclaimed() -> int:
        lines = workers.workers["b"].events("shard.loaded")
        fields = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in lines]
        return sum(int(f["reclaimed"]) for f in fields if int(f["shard"]) in a_shards)

    workers.wait_until(lambda: reclaimed() == 50, timeout_s=5, what="b reclaiming 50 claims")
    took += workers.wait_until(
        lambda: (
            WorkflowRun.objects.filter(state="completed").count() == 10_000
            and records("inflight").keys() == set(keys)
        ),
        timeout_s=60,
        what="every run woken and completed, and a's 50 handlers run again",
        require_alive=["b"],
    )
    metric(record_property, "all_done_after_exit_s", round(took, 2))
    metric(record_property, "runs_on_a", on_a)
    a_tokens = workers.workers["a"].leases_taken()
    by_a = Timer.objects.filter(kind="workflow", fire_at_ms=wake).values_list(
        "shard", "fired_token"
    )
    metric(record_property, "woken_by_a", sum(1 for pair in by_a if pair in a_tokens))
    assert not WorkflowRun.objects.filter(finished_at__lt=at(wake)).exists(), "woke early"
    assert max(records("inflight").values()) == 1


# -- SIGKILL right after a cron occurrence commits ------------------------------------------------


def test_sigkill_100ms_after_a_cron_occurrence_commits_then_restart(workers, record_property):
    """An atomic and an ``atomic=False`` schedule, every second, ``fire_all``: every
    occurrence runs exactly once across the kill, the one committed just before it too."""
    workers.start("c", env=SHORT_TTL)
    workers.wait_until(lambda: len(owned_by("c")) == SHARDS, timeout_s=30, what="c ready")
    names = {"kill-atomic": True, "kill-outside": False}
    first = {
        name: schedules.create(
            name,
            "testproject.demo.crons.record",
            every=timedelta(seconds=1),
            catch_up="fire_all",
            grace=timedelta(seconds=30),
            atomic=atomic,
        ).next_ms
        for name, atomic in names.items()
    }

    def committed() -> int:
        return CronSchedule.objects.get(name="kill-outside").fired_count

    workers.wait_until(lambda: committed() >= 2, timeout_s=15, what="two runs", require_alive=["c"])
    before = committed()
    while committed() == before:  # the next occurrence's bookkeeping commits
        time.sleep(0.002)
    time.sleep(0.1)
    workers.kill("c")
    last = CronSchedule.objects.get(name="kill-outside").last_scheduled_ms
    workers.start("c", env=SHORT_TTL)
    restarted = now_ms()
    workers.wait_until(
        lambda: all(
            FireRecord.objects.filter(
                key__startswith=f"{n}:", fired_at_ms__gt=restarted + 1_000
            ).exists()
            for n in names
        ),
        timeout_s=30,
        what="both schedules running again on time after the restart",
    )
    for name in names:
        schedules.pause(name)
    workers.stop_all()
    for name in names:
        row = CronSchedule.objects.get(name=name)
        ran = Counter(
            FireRecord.objects.filter(key__startswith=f"{name}:").values_list(
                "due_at_ms", flat=True
            )
        )
        expected = range(first[name], row.next_ms, 1_000)
        assert ran[last] == 1, (name, last, ran)
        assert {o: ran[o] for o in expected if ran[o] != 1} == {}, (name, row.skipped_count, ran)
        assert set(ran) <= set(expected)
    metric(record_property, "killed_ms_after_commit", 100)
