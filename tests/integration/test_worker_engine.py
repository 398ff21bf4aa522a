"""The worker engine in-process, driven turn by turn with a manual clock (no sleeping).

Runs on SQLite and on PostgreSQL. Multi-process behaviour (kill -9, SIGSTOP, several
workers) is in tests/acceptance.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

import durable
from durable.models import ShardLease, Timer, WorkerNode
from durable.worker.batches import pack
from durable.worker.engine import Engine
from testproject.demo import probes
from testproject.demo.models import FireRecord
from tests.integration.polling import wait_for as _wait_for
from tests.integration.sharding_support import keys_in_shards

START_MS = 1_900_000_000_000
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def engine(start_engine):
    eng = start_engine({"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0})
    eng.stats.keep_lateness = True
    assert sorted(eng.runners) == [0, 1, 2, 3]
    return eng


def keys(prefix=""):
    return sorted(FireRecord.objects.filter(key__startswith=prefix).values_list("key", flat=True))


def test_fires_at_due_time_never_early_and_exactly_once(engine, clock):
    for i in range(20):
        durable.schedule(probes.record, args=[f"t{i}"], delay=timedelta(milliseconds=100 * i + 50))
    clock.advance(49)
    engine.tick()
    assert keys("t") == []
    for _ in range(25):
        clock.advance(100)
        engine.tick()
    assert keys("t") == sorted(f"t{i}" for i in range(20))
    for rec in FireRecord.objects.all():
        assert rec.fired_at_ms >= rec.due_at_ms, "fired early"
    assert Timer.objects.filter(state="fired").count() == 20
    assert all(lat >= 0 for lat in engine.stats.lateness_ms)


def test_rolled_back_schedule_never_fires(engine, clock):
    with pytest.raises(RuntimeError), transaction.atomic():
        durable.schedule(probes.record, args=["ghost"], delay=timedelta(milliseconds=10))
        raise RuntimeError("roll back")
    clock.advance(5_000)
    engine.tick()
    assert keys("ghost") == [] and Timer.objects.count() == 0


def test_retry_with_backoff_then_success_commits_one_effect(engine, clock):
    durable.schedule(probes.fail_until, args=["r", 3])
    for _ in range(40):
        engine.tick()
        clock.advance(500)
    timer = Timer.objects.get()
    assert timer.state == "fired" and timer.attempts == 3
    # Failed attempts rolled back their own rows; the successful one committed once.
    assert keys("r") == ["r", "r:attempt"]


def test_dead_letter_stores_a_sanitized_error(engine, clock):
    durable.schedule(probes.fail_until, args=["d", 99], on_complete=probes.outcome, context="x")
    for _ in range(60):
        engine.tick()
        clock.advance(1_000)
    timer = Timer.objects.get(target__endswith="fail_until")
    assert timer.state == "failed" and timer.attempts == 3
    assert "planned failure" in timer.last_error
    assert "/srv/app" not in timer.last_error and "path.py" in timer.last_error
    assert len(timer.last_error) <= 500
    assert keys("outcome") == ["outcome:x:failed"]


def test_one_failing_handler_does_not_undo_its_neighbours(engine, clock):
    for i in range(5):
        durable.schedule(probes.record, args=[f"n{i}"], key=f"n{i}")
    durable.schedule(probes.fail_until, args=["bad", 99], key="bad")
    clock.advance(1_000)  # on SQLite (no NOTIFY) the rescan finds new timers
    engine.tick()
    assert keys("n") == [f"n{i}" for i in range(5)]
    assert Timer.objects.get(key="bad").state == "pending"  # retry recorded


def test_on_complete_success(engine, clock):
    durable.schedule(probes.record, args=["c"], on_complete=probes.outcome, context={"a": 1})
    clock.advance(1_000)
    engine.tick()  # fires the timer; its follow-up goes straight into the same wheel
    engine.tick()
    assert keys("outcome") == ["outcome:{'a': 1}:success"]
    follow = Timer.objects.get(key__startswith="on_complete:")
    assert follow.kwargs["result"] == {"status": "success", "value": "c"}


def test_external_handler_is_claimed_run_and_completed(engine, clock):
    timer = durable.schedule(probes.record_external, args=["ext"])
    clock.advance(1_000)
    engine.tick()
    assert _wait_for(lambda: Timer.objects.get(pk=timer.pk).state == "fired")
    assert keys("ext") == ["ext"]
    assert engine.firer.in_flight == 0


def test_expired_claim_is_run_again(engine, clock):
    timer = durable.schedule(probes.record_external, args=["lost"])
    # A worker claimed it and died: state firing, claim already expired.
    Timer.objects.filter(pk=timer.pk).update(state="firing", attempts=1, claim_expires_ms=START_MS)
    engine.runners[timer.shard].rescan(clock.now_ms())
    engine.tick()
    assert _wait_for(lambda: Timer.objects.get(pk=timer.pk).state == "fired")
    assert keys("lost") == ["lost"]


def test_fenced_out_worker_commits_nothing(engine, clock):
    timer = durable.schedule(probes.record, args=["fenced"], delay=timedelta(seconds=1))
    engine.tick()
    # Another worker takes the shard over: the token moves on.
    ShardLease.objects.filter(shard=timer.shard).update(owner="other", token=999)
    clock.advance(2_000)
    engine.tick()
    assert keys("fenced") == []
    assert Timer.objects.get(pk=timer.pk).state == "pending"
    assert timer.shard not in engine.runners


def test_only_the_horizon_is_in_memory(engine, clock):
    far = durable.schedule(probes.record, args=["far"], delay=timedelta(days=30))
    near = durable.schedule(probes.record, args=["near"], delay=timedelta(minutes=5))
    for runner in engine.runners.values():  # what a new owner loads: backlog + horizon
        runner.rebuild(clock.now_ms())
    assert near.pk in engine.runners[near.shard].wheel
    assert far.pk not in engine.runners[far.shard].wheel
    clock.advance(timedelta(days=30))
    engine.tick()
    engine.tick()
    assert keys() == ["far", "near"]


def test_rescan_finds_a_timer_whose_notice_never_came(engine, clock, settings):
    engine.tick()
    settings.DURABLE = {**settings.DURABLE, "NOTIFY": False}
    timer = durable.schedule(probes.record, args=["quiet"], delay=timedelta(seconds=3))
    clock.advance(1_000)
    engine.tick()  # rescan interval (1 s) passed: the row is read
    assert timer.pk in engine.runners[timer.shard].wheel
    clock.advance(2_500)
    engine.tick()
    assert keys("quiet") == ["quiet"]


def test_unknown_handler_retries_then_dead_letters(engine, clock):
    Timer.objects.create(
        shard=0,
        bucket=START_MS >> 16,
        fire_at_ms=START_MS,
        target="nope.gone",
        max_attempts=2,
        backoff_base_s=0.1,
        backoff_max_s=0.1,
    )
    engine.runners[0].rescan(clock.now_ms())
    for _ in range(5):
        engine.tick()
        clock.advance(1_000)
    timer = Timer.objects.get(target="nope.gone")
    assert timer.state == "failed" and "unknown handler 'nope.gone'" in timer.last_error


def test_shutdown_releases_leases_and_marks_the_node_stopped(engine, clock):
    engine.shutdown(wait_s=1)
    assert not ShardLease.objects.exclude(owner="").exists()
    assert WorkerNode.objects.get(name="test-node").stopped_at is not None


def test_pruning_deletes_old_finished_rows(engine, clock):
    durable.schedule(probes.record, args=["old"])
    clock.advance(1_000)
    engine.tick()
    assert Timer.objects.filter(state="fired").count() == 1
    Timer.objects.update(updated_at="2000-01-01T00:00:00Z")
    engine.chores.prune(clock.now_ms())
    assert Timer.objects.count() == 0


def test_fair_share_with_two_workers(engine, clock):
    other = Engine(node="second", clock=clock)
    other.start()
    clock.advance(10_000)  # both heartbeat-fresh; the first gives up its extra shards
    engine.tick()
    other.tick()
    assert len(engine.runners) == 2 and len(other.runners) == 2
    assert set(engine.runners).isdisjoint(other.runners)
    other.executor.shutdown(wait=True)


def test_a_failing_handler_is_not_called_again_in_the_careful_redo(engine, clock):
    durable.schedule(probes.fail_until, args=["once", 99], key="once")
    clock.advance(1_000)
    engine.tick()
    # One attempt: its row rolled back, and the redo with savepoints did not call it again.
    timer = Timer.objects.get(key="once")
    assert timer.attempts == 1 and timer.state == "pending"
    assert probes.CALLS["once"] == 1


def test_handlers_see_their_shard_and_fencing_token(engine, clock):
    timer = durable.schedule(probes.record, args=["ctx"])
    clock.advance(1_000)
    engine.tick()
    assert probes.LAST_CONTEXT["ctx"] == (timer.shard, engine.runners[timer.shard].token)


def test_a_row_moved_later_after_loading_does_not_fire_early(engine, clock):
    timer = durable.schedule(probes.record, args=["moved"], delay=timedelta(seconds=2))
    for runner in engine.runners.values():
        runner.rebuild(clock.now_ms())
    assert timer.pk in engine.runners[timer.shard].wheel
    later = timer.fire_at_ms + 60_000
    Timer.objects.filter(pk=timer.pk).update(fire_at_ms=later, bucket=later >> 16)
    clock.advance(3_000)
    engine.tick()
    assert keys("moved") == []
    clock.set(later)
    engine.tick()
    engine.tick()
    assert keys("moved") == ["moved"]


def _keys_in_every_shard(shards: int, per_shard: int) -> dict[int, list[str]]:
    return keys_in_shards("spread", shards, per_shard, shards)


def test_due_timers_of_several_shards_fire_in_one_fenced_transaction(engine, clock):
    spread = _keys_in_every_shard(4, 3)
    for keys_of_shard in spread.values():
        for key in keys_of_shard:
            durable.schedule(probes.record, args=[key], key=key, delay=timedelta(seconds=1))
    for runner in engine.runners.values():  # SQLite has no NOTIFY: load them now
        runner.rescan(clock.now_ms())
    clock.advance(1_000)
    with CaptureQueriesContext(connection) as queries:
        assert engine.tick() == 12
    sql = [q["sql"] for q in queries.captured_queries]
    fences = [s for s in sql if "FROM durable_shardlease WHERE shard" in s]
    marks = [s for s in sql if s.startswith("UPDATE durable_timer SET state")]
    # One batch: its attempts counted (fenced) and committed first, then one fenced
    # transaction that runs the handlers and marks them all fired in one UPDATE.
    assert len(fences) == 2 and len(marks) == 1, sql
    assert keys("spread") == sorted(k for ks in spread.values() for k in ks)
    for timer in Timer.objects.all():  # each row carries its own shard's token
        assert timer.fired_token == engine.runners[timer.shard].token
        assert (timer.attempts, timer.claim_token) == (1, None)


def test_a_lost_shard_leaves_the_rest_of_its_batch_firing(engine, clock):
    spread = _keys_in_every_shard(4, 2)
    for keys_of_shard in spread.values():
        for key in keys_of_shard:
            durable.schedule(probes.record, args=[key], key=key, delay=timedelta(seconds=1))
    for runner in engine.runners.values():
        runner.rescan(clock.now_ms())
    ShardLease.objects.filter(shard=2).update(owner="other", token=999)
    clock.advance(1_000)
    assert engine.tick() == 6
    assert keys("spread") == sorted(k for s, ks in spread.items() if s != 2 for k in ks)
    assert set(Timer.objects.filter(state="pending").values_list("key", flat=True)) == set(
        spread[2]
    )
    assert 2 not in engine.runners and sorted(engine.runners) == [0, 1, 3]


def test_a_timer_scheduled_by_a_handler_enters_the_wheel_at_commit(engine, clock, settings):
    durable.schedule(probes.record_then_schedule, args=["chain", 10], key="chain")
    clock.advance(1_000)
    engine.tick()
    child = Timer.objects.get(key="chain:next")
    # No NOTIFY was read (tick() does not listen) and no rescan was due: the firer put it
    # in its shard's wheel itself, right after the batch committed.
    engine._drain_inbox()
    assert child.pk in engine.runners[child.shard].wheel
    clock.advance(10)
    engine.tick()
    assert keys("chain") == ["chain", "chain:next"]


def test_pack_cuts_batches_across_shards_and_splits_big_shards():
    a, b, c = (SimpleNamespace(shard=s) for s in range(3))
    work = [(a, [1, 2]), (b, [3, 4, 5, 6, 7]), (c, []), (a, [8])]
    batches = pack(work, 3)
    assert [[(r.shard, ids) for r, ids in batch] for batch in batches] == [
        [(0, [1, 2]), (1, [3])],
        [(1, [4, 5, 6])],
        [(1, [7]), (0, [8])],
    ]


@pytest.mark.postgres
def test_the_idle_guard_is_set_per_transaction_never_for_the_session(engine):
    """The loop's transactions carry the frozen-worker timeout; its session does not.

    Behind a pooler the session is a server connection other clients share (see
    tests/acceptance/test_pgbouncer.py); per transaction the guard cannot leak.
    """

    def timeout() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW idle_in_transaction_session_timeout")
            return cursor.fetchone()[0]

    assert timeout() == "0"  # autocommit: no transaction, nothing set
    with transaction.atomic():
        assert timeout() == "20s"  # 2 x LEASE_TTL_S, set by the transaction's first statement
        with transaction.atomic():  # a savepoint: set once per transaction
            assert timeout() == "20s"
    assert timeout() == "0"
    engine.shutdown(wait_s=0)
    with transaction.atomic():
        assert timeout() == "0"  # the guard leaves with the engine


@pytest.mark.postgres
def test_a_new_engines_guard_replaces_an_earlier_one(engine):
    """One guard per connection: the latest engine's timeout, not a stale engine's."""
    from durable.conf import DurableSettings
    from durable.worker import housekeeping

    housekeeping.guard_session(connection, DurableSettings(LEASE_TTL_S=3600.0))
    housekeeping.guard_session(connection, engine.conf)
    guards = [w for w in connection.execute_wrappers if isinstance(w, housekeeping.IdleGuard)]
    assert len(guards) == 1
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SHOW idle_in_transaction_session_timeout")
        assert cursor.fetchone()[0] == "20s"
    engine.shutdown(wait_s=0)
