"""``durable.scheduling.operations``: moving timers never breaks "never early" nor loses them.

The point of replacing a moved timer (rather than updating its row) is the worker's
wheel, which holds the old id at the old time. These tests load a timer into a real
engine's wheel first, then move it, and check what the worker fires and when.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

import durable
from durable.exceptions import TimerError
from durable.models import Timer
from durable.scheduling import operations
from testproject.demo import probes
from testproject.demo.models import FireRecord

pytestmark = pytest.mark.django_db(transaction=True)
START_MS = 1_900_000_000_000
S = 1_000


@pytest.fixture
def engine(start_engine):
    return start_engine({"SHARDS": 2, "RESCAN_INTERVAL_S": 1.0}, node="ops-node", threads=1)


def turn(engine, clock, ms=S):
    clock.advance(ms)
    engine.tick()


def load(engine, timer) -> None:
    """Put the timer in its shard's wheel now, as a NOTIFY from its transaction would."""
    assert engine.runners[timer.shard].add(timer.pk, timer.fire_at_ms)


def fired(key: str) -> int:
    return FireRecord.objects.filter(key=key).count()


def test_a_postponed_timer_does_not_fire_at_its_old_time(engine, clock):
    timer = durable.schedule(probes.record, args=["later"], delay=timedelta(seconds=5))
    load(engine, timer)
    new = operations.reschedule(timer, delay=timedelta(minutes=10))
    for _ in range(10):
        turn(engine, clock)
    assert fired("later") == 0
    assert Timer.objects.get(pk=timer.pk).state == "canceled"
    turn(engine, clock, 10 * 60 * S)
    turn(engine, clock)
    assert fired("later") == 1
    assert Timer.objects.get(pk=new.pk).state == "fired"


def test_fire_now_fires_a_timer_already_in_the_wheel_at_once(engine, clock):
    timer = durable.schedule(probes.record, args=["soon"], delay=timedelta(minutes=30))
    load(engine, timer)
    operations.fire_now(timer)
    turn(engine, clock)
    turn(engine, clock)
    assert fired("soon") == 1  # not half an hour later


def test_retry_runs_a_dead_letter_again(engine, clock):
    timer = durable.schedule(probes.fail_until, args=["flaky", 4], delay=timedelta(seconds=1))
    for _ in range(40):
        turn(engine, clock, 5 * S)
    assert Timer.objects.get(pk=timer.pk).state == "failed"  # 3 attempts, needs 4
    new = operations.retry(timer)
    for _ in range(40):
        turn(engine, clock, 5 * S)
    again = Timer.objects.get(pk=new.pk)
    assert (again.state, again.attempts) == ("failed", 3)  # a fresh set of three attempts
    assert operations.retry(timer) is None  # no longer failed: it was replaced


def test_bad_input_and_rows_that_cannot_move(clock):
    timer = durable.schedule(probes.record, args=["x"], delay=timedelta(hours=1))
    with pytest.raises(ValueError, match="naive"):
        operations.reschedule(timer, at=datetime(2030, 1, 1))
    with pytest.raises(TypeError, match="exactly one"):
        operations.reschedule(timer)
    with pytest.raises(ValueError, match="negative"):
        operations.reschedule(timer, delay=timedelta(seconds=-1))
    assert operations.fire_now(10**9) is None  # no such timer
    past = operations.reschedule(timer, at=datetime(2000, 1, 1, tzinfo=UTC))
    assert past.fire_at_ms == START_MS  # a past instant means now, never "before now"
    durable.schedules.create("digest", "testproject.demo.crons.record", every=timedelta(hours=1))
    occurrence = Timer.objects.get(kind="cron")
    with pytest.raises(TimerError, match="run its schedule now"):
        operations.fire_now(occurrence)
    assert Timer.objects.get(pk=occurrence.pk).state == "pending"
