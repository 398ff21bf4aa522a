"""A worker that survives its batch's failure gives back the attempts it counted.

Found by the chaos run (``make chaos``, seed 20261201): healthy timers were
dead-lettered with ``AttemptsExhausted: attempt 5 of 5 started and never finished``.
Attempts are counted before a batch runs, committed on their own (DESIGN §12); when
the nemesis terminated a worker's session mid-batch, the batch rolled back, the worker
lived on, and every timer in the batch had spent an attempt none of them had used. Now
the worker gives them back (``durable.worker.attempts``), on a condition (the row still
has the attempts and token it was counted with), except where the failure may be the
handler's own: a handler that breaks its batch's session every time is still
dead-lettered within its attempts.
"""

from __future__ import annotations

import dataclasses
import time

import psycopg
import pytest
from django.db import InterfaceError, OperationalError, connections, transaction

import durable
from durable.models import Timer, TimerState
from durable.storage import claims
from durable.worker.attempts import AttemptTracker
from testproject.demo import chaos, probes
from testproject.demo.models import FireRecord
from tests.integration.polling import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SETTINGS = {"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}


@pytest.fixture
def engine(start_engine):
    return start_engine(dict(SETTINGS), threads=2)


def turn(engine, clock, step_ms=200):
    """One turn as ``Engine.run`` takes it: a database error ends it, and the next one
    renews and rescans everything due."""
    clock.advance(step_ms)
    try:
        engine.tick()
    except (OperationalError, InterfaceError) as exc:
        engine._on_database_error(exc, 0.0)
        return exc
    return None


def state(timer):
    timer.refresh_from_db()
    return timer.state, timer.attempts


def ledger(prefix):
    return sorted(FireRecord.objects.filter(key__startswith=prefix).values_list("key", flat=True))


@pytest.mark.postgres
def test_a_batch_whose_session_is_terminated_spends_no_attempt(engine, clock):
    # One attempt each: before the fix, the lost batch spent it, and the next turn
    # dead-lettered them all (AttemptsExhausted) without calling them again.
    ran = [durable.schedule(probes.record, args=[f"ran{i}"], max_attempts=1) for i in range(2)]
    external = durable.schedule(probes.record_external, args=["ext"], max_attempts=1)
    clock.advance(1)  # the dropper comes last in the batch, after the others ran
    dropper = durable.schedule(chaos.drop_batch_session, args=["drop"])
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    assert isinstance(turn(engine, clock), OperationalError | InterfaceError)
    for _ in range(6):
        turn(engine, clock)
    # The external handler runs on a pool thread after its claim commits: on a loaded
    # machine it may still be running after the turns (CI saw it `firing`), so wait for
    # its completion (10 s at most) rather than for a number of turns.
    wait_for(lambda: state(external)[0] != TimerState.FIRING)
    assert [state(t) for t in ran] == [(TimerState.FIRED, 1)] * 2
    assert state(external) == (TimerState.FIRED, 1)
    assert state(dropper) == (TimerState.FIRED, 1)
    assert ledger("ran") == ["ran0", "ran1"] and ledger("drop") == ["drop"], "once each"
    assert ledger("ext") == ["ext"]


@pytest.mark.postgres
def test_a_handler_that_breaks_its_batch_every_time_is_still_dead_lettered(engine, clock):
    neighbours = [durable.schedule(probes.record, args=[f"n{i}"]) for i in range(2)]
    clock.advance(1)
    poison = durable.schedule(chaos.drop_batch_session, args=["p"], kwargs={"every_time": True})
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    errors = [turn(engine, clock) for _ in range(8)]
    assert sum(e is not None for e in errors) <= 2, "at most with its neighbours, then alone"
    assert [state(t) for t in neighbours] == [(TimerState.FIRED, 1)] * 2
    assert state(poison) == (TimerState.FAILED, 1)
    assert "AttemptsExhausted: attempt 1 of 1" in poison.last_error
    assert ledger("p") == [] and ledger("n") == ["n0", "n1"]


def test_give_back_is_conditional_on_the_counted_attempts_and_token(engine, clock):
    timer = durable.schedule(probes.record, args=["x"])
    clock.advance(1)
    token = engine.runners[timer.shard].token
    with transaction.atomic():
        counted = claims.count_attempts("default", {timer.shard: token}, [timer.pk], clock.now_ms())
    assert counted.attempts == {timer.pk: 1}
    stale = {timer.pk: (1, token + 1)}, {timer.pk: (2, token)}
    assert [claims.give_back("default", c, clock.now_ms(), suspect=False) for c in stale] == [0, 0]
    assert claims.give_back("default", {timer.pk: (1, token)}, clock.now_ms(), suspect=True) == 1
    row = Timer.objects.get(pk=timer.pk)
    assert (row.attempts, row.claim_token) == (0, token), "still a suspect"
    with transaction.atomic():
        again = claims.count_attempts("default", {timer.shard: token}, [timer.pk], clock.now_ms())
    assert again.suspects == {timer.pk}
    assert claims.give_back("default", {timer.pk: (1, token)}, clock.now_ms(), suspect=False) == 1
    row.refresh_from_db()
    assert (row.attempts, row.claim_token) == (0, None)
    finished = {"state": TimerState.FIRED, "attempts": 1, "claim_token": token}
    Timer.objects.filter(pk=timer.pk).update(**finished)
    assert claims.give_back("default", {timer.pk: (1, token)}, clock.now_ms(), suspect=False) == 0


def test_a_claim_whose_commit_the_worker_could_not_confirm_runs_again_at_once(engine, clock):
    # Found by the chaos run (seed 20261202): a batch's commit went through while its
    # session was terminated, so the worker saw an error and never ran its external
    # claims; they stayed firing under its live token until a takeover re-ran them
    # (30 to 60 s later; CLAIM_TIMEOUT_S is 300 s). Giving the attempts back now also
    # expires such a claim: due at once.
    timer = durable.schedule(probes.record_external, args=["doubt"])
    token = engine.runners[timer.shard].token
    claimed = {"state": TimerState.FIRING, "attempts": 1, "claim_token": token}
    until = clock.now_ms() + 300_000
    Timer.objects.filter(pk=timer.pk).update(**claimed, claim_expires_ms=until)
    given = claims.give_back("default", {timer.pk: (1, token)}, clock.now_ms(), suspect=False)
    row = Timer.objects.get(pk=timer.pk)
    assert given == 1 and (row.attempts, row.claim_expires_ms) == (0, clock.now_ms())
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    turn(engine, clock)
    deadline = time.monotonic() + 10
    while engine.firer.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state(timer) == (TimerState.FIRED, 1) and ledger("doubt") == ["doubt"]


# A claim of an older owner (its worker killed after the claim committed, the shard
# taken over) is re-run by the new owner: the row is still ``firing``, with its claim
# expired. Found by the chaos run (seed 20261203, external timer 798): such a row that
# a batch counted and then left for later (the batch's time budget spent by a hanging
# atomic handler, or no handler thread free) kept that attempt, because the give-back of
# left-over timers matched only ``pending`` rows; every batch that left it over spent
# one more, and the timer was dead-lettered (``AttemptsExhausted``) without its handler
# having run once. An attempt counts only when its handler may have started.


def stale_claim(timer, clock, attempts=1):
    """Make ``timer`` look like an older owner's claim, expired: ``attempts`` spent."""
    Timer.objects.filter(pk=timer.pk).update(
        state=TimerState.FIRING,
        attempts=attempts,
        claim_expires_ms=clock.now_ms() - 1,
        claim_token=0,  # older than any lease token the engine holds (they start at 1)
    )


def test_a_reclaimed_timer_left_over_by_a_spent_budget_keeps_its_attempts(start_engine, clock):
    from testproject.demo import poison

    engine = start_engine({**SETTINGS, "BATCH_TIME_BUDGET_S": 0.1}, threads=2)
    hang = durable.schedule(poison.atomic_sleeper, args=[30])  # 0.3 s timeout, 1 attempt
    clock.advance(1)  # the external timer comes after the hang in the batch
    reclaimed = durable.schedule(probes.record_external, args=["left"])  # max_attempts=2
    stale_claim(reclaimed, clock)
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    clock.advance(1)
    engine.tick()  # the hang spends the budget: the redo leaves the external timer over
    assert state(hang) == (TimerState.FAILED, 1)
    assert state(reclaimed) == (TimerState.FIRING, 1), "its handler did not start"
    for _ in range(3):
        turn(engine, clock)
        assert _settled(engine)
    assert state(reclaimed) == (TimerState.FIRED, 2)
    assert ledger("left") == ["left"]


def test_a_reclaimed_timer_waiting_for_a_thread_keeps_its_attempts(start_engine, clock):
    import threading

    from testproject.demo import poison

    engine = start_engine(dict(SETTINGS), threads=1)
    gate = poison.GATES.setdefault("busy", threading.Event())
    gate.clear()
    busy = durable.schedule(poison.gated, args=["busy"])
    clock.advance(1)
    reclaimed = durable.schedule(probes.record_external, args=["wait"])  # max_attempts=2
    stale_claim(reclaimed, clock)
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    clock.advance(1)
    try:
        engine.tick()  # the one thread takes the gated timer; the other waits for it
        assert state(busy) == (TimerState.FIRING, 1)
        assert engine.firer.external.parked == 1
        assert state(reclaimed) == (TimerState.FIRING, 1), "its handler did not start"
    finally:
        gate.set()
    for _ in range(5):
        turn(engine, clock)
        assert _settled(engine)
    assert state(busy) == (TimerState.FIRED, 1)
    assert state(reclaimed) == (TimerState.FIRED, 2)
    assert ledger("wait") == ["wait"]


def _settled(engine, timeout_s=10.0):
    """Wait until no external handler of ``engine`` is in flight."""
    deadline = time.monotonic() + timeout_s
    while engine.firer.in_flight and time.monotonic() < deadline:
        time.sleep(0.005)
    return not engine.firer.in_flight


# An external handler runs only after the batch that claims its timer commits. A worker
# that died between counting a batch's attempts and that commit (a neighbour's
# os._exit, a SIGKILL) never started the external handlers in it: their rows are left
# pending with the count's token set (suspects). That attempt could not have run, so it
# does not count toward max_attempts.


def crashed_before_commit(engine, clock, timer):
    """Count ``timer``'s attempt and commit only that, as a worker killed mid-batch did."""
    tokens = {s: r.token for s, r in engine.runners.items()}
    with transaction.atomic():
        counted = claims.count_attempts("default", tokens, [timer.pk], clock.now_ms())
    assert counted.ids == {timer.pk}


def test_an_external_attempt_cut_short_before_its_claim_is_given_back(engine, clock):
    timer = durable.schedule(probes.record_external, args=["cut"])  # max_attempts=2
    atomic = durable.schedule(probes.record, args=["cut-atomic"], max_attempts=2)
    crashed_before_commit(engine, clock, timer)
    crashed_before_commit(engine, clock, atomic)
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    for _ in range(4):
        turn(engine, clock)
        assert _settled(engine)
    assert state(timer) == (TimerState.FIRED, 1), "the cut attempt never started it"
    assert ledger("cut") == ["cut", "cut-atomic"]
    assert state(atomic) == (TimerState.FIRED, 2), "an atomic handler may have run: spent"


def test_an_external_timer_whose_last_attempt_never_started_is_not_dead_lettered(engine, clock):
    timer = durable.schedule(probes.record_external, args=["last"])  # max_attempts=2
    Timer.objects.filter(pk=timer.pk).update(attempts=1)  # attempt 1 ran (and failed)
    crashed_before_commit(engine, clock, timer)  # attempt 2: its worker died before
    assert state(timer) == (TimerState.PENDING, 2)
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    for _ in range(4):
        turn(engine, clock)
        assert _settled(engine)
    assert state(timer) == (TimerState.FIRED, 2)
    assert ledger("last") == ["last"]


def test_an_external_suspect_waiting_for_a_thread_keeps_its_number(start_engine, clock):
    import threading

    from testproject.demo import poison

    engine = start_engine(dict(SETTINGS), threads=1)
    gate = poison.GATES.setdefault("hold", threading.Event())
    gate.clear()
    busy = durable.schedule(poison.gated, args=["hold"])
    clock.advance(1)
    timer = durable.schedule(probes.record_external, args=["num"])  # max_attempts=2
    crashed_before_commit(engine, clock, timer)
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    clock.advance(1)
    try:
        engine.tick()  # the gated timer takes the one thread; the suspect waits
        assert engine.firer.external.parked == 1
        timer.refresh_from_db()
        assert (timer.state, timer.attempts, timer.claim_token) == (TimerState.PENDING, 0, None)
    finally:
        gate.set()
    for _ in range(5):
        turn(engine, clock)
        assert _settled(engine)
    assert state(busy) == (TimerState.FIRED, 1)
    assert state(timer) == (TimerState.FIRED, 1)
    assert ledger("num") == ["num"]


def _session() -> psycopg.Connection:
    """Another session on the test database: the new owner of the shard, say."""
    settings = connections["default"].settings_dict
    return psycopg.connect(
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        user=settings["USER"],
        password=settings["PASSWORD"] or None,
        dbname=settings["NAME"],
    )


@pytest.mark.postgres
def test_giving_back_leaves_no_row_locked_between_its_statements(engine, clock):
    # Found in the Raft SIGSTOP acceptance test: the old owner was frozen inside its
    # give-back transaction (its first UPDATE run, its COMMIT not sent), so its row locks
    # stayed until it was resumed (or PostgreSQL's idle timeout, 2 x LEASE_TTL_S, ended
    # it). The shard's new owner counted those rows (suspects, run alone) and its whole
    # fire loop waited on the lock: every shard of it fired nothing for 5 s. Each
    # give-back statement now commits on its own, so a freeze anywhere leaves no lock.
    timers = [durable.schedule(probes.record, args=[key]) for key in ("clear", "suspect")]
    clock.advance(1)
    tokens = {t.shard: engine.runners[t.shard].token for t in timers}
    ids = [t.pk for t in timers]
    counted = claims.count_attempts("default", tokens, ids, clock.now_ms())
    assert counted.ids == set(ids)
    # The second ran in the failed batch (a suspect now); the first never started.
    counted = dataclasses.replace(counted, suspects={ids[1]})
    tracker = AttemptTracker("default", counted, {t.pk: tokens[t.shard] for t in timers})
    locked_after: list[list[int]] = []
    other = _session()

    def look(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql.startswith("UPDATE durable_timer SET attempts = attempts - 1"):
            # What the frozen worker would leave behind if it stopped right here.
            free = other.execute(
                "SELECT id FROM durable_timer WHERE id = ANY(%s) FOR UPDATE SKIP LOCKED", [ids]
            ).fetchall()
            other.rollback()
            locked_after.append(sorted(set(ids) - {row[0] for row in free}))
        return result

    try:
        with connections["default"].execute_wrapper(look):
            assert tracker.give_back(clock.now_ms(), reconnect=False) == 2
    finally:
        other.close()
    assert locked_after == [[], []], "a row stayed locked after a give-back statement"
    rows = dict(Timer.objects.filter(pk__in=ids).values_list("pk", "claim_token"))
    assert rows == {ids[0]: None, ids[1]: tokens[timers[1].shard]}
