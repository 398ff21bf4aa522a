"""Poison work is contained (DESIGN §12), in-process, on SQLite and PostgreSQL.

A handler that raises any ``BaseException``, hangs past its timeout, or whose firing
trips an error in durable's own bookkeeping fails that one attempt: the engine's turn
returns, the neighbours of its batch fire, and the last attempt dead-letters it. The
attempt is counted before the handler runs, so one that takes its process down has
used it all the same. Real worker processes (``os._exit``, SIGKILL) are in
tests/acceptance/test_poison_cluster.py.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import pytest
from django.db import transaction

import durable
from durable.models import Timer, TimerState
from durable.storage import claims
from testproject.demo import poison, probes
from testproject.demo.models import FireRecord
from tests.integration.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SETTINGS = {"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}


@pytest.fixture
def engine(start_engine):
    return start_engine(dict(SETTINGS), threads=2)


def keys(prefix=""):
    return sorted(FireRecord.objects.filter(key__startswith=prefix).values_list("key", flat=True))


def load(engine, clock):
    """SQLite has no NOTIFY: put what was scheduled into the wheels now."""
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())


def turns(engine, clock, n=10, step_ms=200):
    for _ in range(n):
        clock.advance(step_ms)
        engine.tick()
        deadline = time.monotonic() + 10
        while engine.firer.in_flight and time.monotonic() < deadline:
            time.sleep(0.005)


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "BaseException"])
def test_an_atomic_base_exception_fails_only_its_attempt(engine, clock, kind):
    bad = durable.schedule(poison.atomic_poison, args=[kind])
    for i in range(5):
        durable.schedule(probes.record, args=[f"n{i}"])
    load(engine, clock)
    engine.tick()  # returns: nothing the handler raised reaches the engine
    assert keys("n") == [f"n{i}" for i in range(5)], "the neighbours fired"
    bad.refresh_from_db()
    assert (bad.state, bad.attempts) == (TimerState.PENDING, 1)
    raised = "Poison" if kind == "BaseException" else kind
    assert f"HandlerAborted: the handler raised {raised}" in bad.last_error
    turns(engine, clock)
    bad.refresh_from_db()
    assert (bad.state, bad.attempts) == (TimerState.FAILED, 2)
    assert keys("poison") == [], "its writes rolled back with each attempt"


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "BaseException"])
def test_an_external_base_exception_fails_its_attempt_logged_and_counted(
    engine, clock, kind, caplog
):
    bad = durable.schedule(poison.external_poison, args=[kind])
    load(engine, clock)
    caplog.set_level(logging.WARNING, logger="durable.worker")
    turns(engine, clock, n=1)
    bad.refresh_from_db()
    assert (bad.state, bad.attempts) == (TimerState.PENDING, 1), bad.last_error
    assert "HandlerAborted" in bad.last_error
    assert any(f"timer={bad.pk} " in r.getMessage() for r in caplog.records
               if r.getMessage().startswith("timer.error"))  # fmt: skip
    errors = engine.metrics.errors.labels(str(bad.shard))._value.get()
    assert errors == 1
    turns(engine, clock)
    bad.refresh_from_db()
    assert (bad.state, bad.attempts) == (TimerState.FAILED, 2)


def test_a_database_error_raised_by_a_handler_fails_only_its_attempt(engine, clock):
    bad = durable.schedule(poison.atomic_poison, args=["DatabaseError"])
    durable.schedule(probes.record, args=["n0"])
    load(engine, clock)
    engine.tick()
    assert keys("n") == ["n0"]
    bad.refresh_from_db()
    assert bad.state == TimerState.PENDING and "no_such_table_durable_poison" in bad.last_error


def test_a_hung_atomic_handler_is_interrupted_at_its_timeout(engine, clock):
    bad = durable.schedule(poison.atomic_sleeper, args=[30])
    durable.schedule(probes.record, args=["n0"])
    load(engine, clock)
    started = time.monotonic()
    engine.tick()
    assert time.monotonic() - started < 5, "the turn waited for the sleeper"
    assert keys("n") == ["n0"]
    bad.refresh_from_db()
    assert bad.state == TimerState.FAILED, "max_attempts=1: the timeout dead-letters it"
    assert "HandlerTimeout: the handler ran past its timeout of 0.3 s" in bad.last_error


def test_a_batch_redone_after_a_hang_keeps_the_budget_the_hang_spent(start_engine, clock):
    # Found by the chaos run: two hanging atomic handlers in one batch, the first on
    # the fast path, the second in the careful redo, which had a budget of its own:
    # the loop was held for two timeouts without renewing its leases, past LEASE_TTL_S.
    engine = start_engine({**SETTINGS, "BATCH_TIME_BUDGET_S": 0.1}, threads=2)
    first = durable.schedule(poison.atomic_sleeper, args=[30])
    clock.advance(1)
    second = durable.schedule(poison.atomic_sleeper, args=[30])
    load(engine, clock)
    engine.tick()
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.state == TimerState.FAILED and "HandlerTimeout" in first.last_error
    assert (second.state, second.attempts) == (TimerState.PENDING, 0), "the redo ran it too"
    turns(engine, clock, n=3)
    second.refresh_from_db()
    assert second.state == TimerState.FAILED and "HandlerTimeout" in second.last_error


def test_a_hung_external_handler_is_abandoned_and_its_thread_replaced(engine, clock):
    gate = poison.GATES.setdefault("slow", threading.Event())
    gate.clear()
    timer = durable.schedule(poison.gated, args=["slow"])
    load(engine, clock)
    engine.tick()
    assert wait_for(lambda: engine.firer.in_flight == 1)
    clock.advance(int(engine.conf.HANDLER_TIMEOUT_S * 1000) + 1)
    engine.tick()  # the watchdog: attempt 1 failed, a fresh thread in the pool
    timer.refresh_from_db()
    assert timer.state == TimerState.PENDING and "HandlerTimeout" in timer.last_error
    assert engine.firer.in_flight == 0 and engine.firer.external.free == 2
    gate.set()  # the abandoned call returns at last: its completion finds no claim
    assert wait_for(lambda: FireRecord.objects.filter(key="slow").exists())
    time.sleep(0.2)
    timer.refresh_from_db()
    assert (timer.state, timer.attempts) == (TimerState.PENDING, 1), "late completion dropped"
    turns(engine, clock, n=3, step_ms=5_000)  # the retry runs (the gate is open now)
    timer.refresh_from_db()
    assert (timer.state, timer.attempts) == (TimerState.FIRED, 2)


def test_no_more_external_claims_than_free_threads(engine, clock):
    for i in range(5):
        poison.GATES.setdefault(f"g{i}", threading.Event()).clear()
        durable.schedule(poison.gated, args=[f"g{i}"])
    load(engine, clock)
    engine.tick()
    states = Timer.objects.values_list("state", "attempts")
    assert sorted(states) == [("firing", 1)] * 2 + [("pending", 0)] * 3
    # The other three wait outside the wheel (no query a turn) until a thread is free.
    assert engine.firer.external.parked == 3
    assert sum(len(r.wheel) for r in engine.runners.values()) == 0
    for i in range(5):
        poison.GATES[f"g{i}"].set()
    turns(engine, clock, n=5)
    assert keys("g") == [f"g{i}" for i in range(5)]
    assert set(Timer.objects.values_list("state", "attempts")) == {("fired", 1)}


def test_a_renewal_logs_due_timers_waiting_for_a_handler_thread(engine, clock, caplog):
    """Parked timers give their attempt back silently; the renewal says they wait."""
    for i in range(3):
        poison.GATES.setdefault(f"b{i}", threading.Event()).clear()
        durable.schedule(poison.gated, args=[f"b{i}"])
    load(engine, clock)
    engine.tick()
    assert engine.firer.external.parked == 1
    caplog.set_level(logging.WARNING, logger="durable.worker")
    clock.advance(int(engine.conf.LEASE_TTL_S * 1000 / 3) + 1)
    engine.tick()  # renews: both threads still held
    busy = [r.getMessage() for r in caplog.records if "worker.handlers_busy" in r.getMessage()]
    assert len(busy) == 1
    assert "parked=1" in busy[0] and "in_flight=2" in busy[0] and "threads=2" in busy[0]
    for i in range(3):
        poison.GATES[f"b{i}"].set()
    turns(engine, clock, n=5)
    assert keys("b") == ["b0", "b1", "b2"]


def test_an_attempt_that_never_finished_counts_and_the_last_one_dead_letters(engine, clock, caplog):
    # As if a worker had counted the attempts and died in the handler (os._exit):
    # nothing else of either attempt was written.
    once = durable.schedule(probes.record, args=["once"], max_attempts=2)
    last = durable.schedule(
        probes.record, args=["last"], max_attempts=1, on_complete=probes.outcome
    )
    tokens = {s: r.token for s, r in engine.runners.items()}
    with transaction.atomic():
        counted = claims.count_attempts("default", tokens, [once.pk, last.pk], clock.now_ms())
    assert counted.ids == {once.pk, last.pk} and not counted.suspects
    with transaction.atomic():  # what the next owner finds: both suspects now
        again = claims.count_attempts("default", tokens, [once.pk], clock.now_ms())
        assert again.suspects == {once.pk}
        transaction.set_rollback(True)
    load(engine, clock)
    caplog.set_level(logging.ERROR, logger="durable.worker")
    turns(engine, clock, n=2)
    once.refresh_from_db()
    last.refresh_from_db()
    assert (once.state, once.attempts) == (TimerState.FIRED, 2), "a suspect runs, alone"
    assert (last.state, last.attempts) == (TimerState.FAILED, 1)
    assert "AttemptsExhausted: attempt 1 of 1 started and never finished" in last.last_error
    assert keys("once") + keys("last") == ["once"], "the exhausted one was not called again"
    follow = Timer.objects.get(key=f"on_complete:{last.pk}")
    assert follow.kwargs["result"]["status"] == "failed"


def test_an_error_in_durables_own_bookkeeping_dead_letters_that_timer_alone(engine, clock):
    # A row no validation would let in today (an older version's, or edited): its retry
    # time does not fit the column, so recording its failure fails in the database.
    bad = durable.schedule(probes.fail_until, args=["bk", 9])
    Timer.objects.filter(pk=bad.pk).update(backoff_base_s=1e300, backoff_max_s=1e300)
    for i in range(3):
        durable.schedule(probes.record, args=[f"n{i}"])
    load(engine, clock)
    engine.tick()  # the engine lives on
    assert keys("n") == ["n0", "n1", "n2"]
    bad.refresh_from_db()
    assert bad.state == TimerState.FAILED
    assert bad.last_error.startswith("firing it failed outside its handler:")
    turns(engine, clock, n=2)
    assert keys("n") == ["n0", "n1", "n2"], "nothing fired twice"


def test_a_claim_past_max_attempts_is_dead_lettered_not_claimed_again(engine, clock):
    timer = durable.schedule(probes.record_external, args=["x"])  # max_attempts=2
    Timer.objects.filter(pk=timer.pk).update(
        state=TimerState.FIRING, attempts=2, claim_expires_ms=clock.now_ms() - 1, claim_token=1
    )
    load(engine, clock)
    turns(engine, clock, n=2)
    timer.refresh_from_db()
    assert (timer.state, timer.attempts) == (TimerState.FAILED, 2)
    assert "AttemptsExhausted" in timer.last_error and keys() == []


def test_a_new_owner_reruns_the_old_owners_claims_at_once(start_engine, clock, caplog):
    poison.GATES.setdefault("claimed", threading.Event()).clear()
    first = start_engine(dict(SETTINGS), node="first", threads=2)
    timer = durable.schedule(poison.gated, args=["claimed"])
    load(first, clock)
    first.tick()
    assert wait_for(lambda: first.firer.in_flight == 1)
    timer.refresh_from_db()
    old_token = first.runners[timer.shard].token
    assert (timer.state, timer.claim_token) == (TimerState.FIRING, old_token)
    # The first worker stops renewing (frozen, or dead); its leases expire.
    clock.advance(int(SETTINGS["LEASE_TTL_S"] * 1000) + 1)
    second = start_engine(None, node="second", threads=2)
    assert timer.shard in second.runners
    new_token = second.runners[timer.shard].token
    assert new_token > old_token
    poison.GATES["claimed"].set()  # both calls may finish: at least once
    caplog.set_level(logging.WARNING, logger="durable.worker")
    turns(second, clock, n=2, step_ms=10)  # well inside CLAIM_TIMEOUT_S (300 s)
    assert wait_for(lambda: first.firer.in_flight == 0)
    timer.refresh_from_db()
    assert (timer.state, timer.fired_token, timer.attempts) == (TimerState.FIRED, new_token, 2)
    assert any("timer.complete_fenced" in r.getMessage() for r in caplog.records), (
        "the old owner's late completion is refused by the fence"
    )


def test_a_workflow_whose_wake_up_is_dead_lettered_fails(engine, clock):
    from testproject.demo.workflows import ten_steps

    run = ten_steps.start(start=1)
    Timer.objects.filter(kind="workflow", target=run.pk).update(attempts=25, max_attempts=25)
    load(engine, clock)
    turns(engine, clock, n=2)
    run.refresh_from_db()
    assert run.state == "failed" and "wake-up timer" in run.error


def test_retry_time_of_a_bad_row_does_not_reach_the_wheel(engine, clock):
    """The split that contains a bookkeeping error also keeps a good batch whole."""
    for i in range(4):
        durable.schedule(probes.record, args=[f"w{i}"], delay=timedelta(milliseconds=10))
    load(engine, clock)
    turns(engine, clock, n=1)
    assert keys("w") == [f"w{i}" for i in range(4)]
    assert set(Timer.objects.values_list("attempts", "claim_token")) == {(1, None)}


@pytest.mark.parametrize(("seconds", "result"), [(0.01, "done"), (30, "gave up")])
def test_a_step_past_its_timeout_fails_its_attempt(engine, clock, seconds, result):
    run = poison.step_with_deadline.start(seconds)
    load(engine, clock)
    started = time.monotonic()
    turns(engine, clock, n=3)
    assert time.monotonic() - started < 10, "the turn waited for the step"
    run.refresh_from_db()
    assert run.state == "completed" and run.result.startswith(result), run.result
    if result == "gave up":
        assert "HandlerTimeout: the step ran past its timeout of 0.3 s" in run.result


def test_a_step_past_handler_timeout_fails_its_attempt_by_default(start_engine, clock):
    """About a setting: HANDLER_TIMEOUT_S (240 s by default) shortened to 0.5 s."""
    engine = start_engine({**SETTINGS, "HANDLER_TIMEOUT_S": 0.5})
    run = poison.step_with_default_deadline.start(30)
    quick = poison.step_with_default_deadline.start(0.01)
    load(engine, clock)
    started = time.monotonic()
    turns(engine, clock, n=3)
    assert time.monotonic() - started < 10, "the turn waited for the step"
    run.refresh_from_db()
    quick.refresh_from_db()
    assert run.state == "completed" and run.result.startswith("gave up"), run.result
    assert "HandlerTimeout: the step ran past its timeout of 0.5 s" in run.result
    assert quick.result == "done"
