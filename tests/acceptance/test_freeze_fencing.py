"""A worker frozen with SIGSTOP past its lease commits nothing for its shards once resumed."""

from __future__ import annotations

import signal
import time
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction

import durable
from durable.core.sharding import shard_for
from durable.models import ShardLease, Timer
from testproject.demo import probes
from tests.acceptance import handlers
from tests.acceptance.helpers import (
    LEASE_TTL_S,
    SHARDS,
    WorkerPool,
    app_name,
    assert_exactly_once,
    fired_count,
    metric,
    now_ms,
    owned_by,
    progress,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def workers(routed_workers):
    """Every test here runs twice: workers connected directly, then through PgBouncer."""
    return routed_workers


def open_transactions(worker: str) -> list[tuple[str, str]]:
    """``(state, query)`` of the worker's sessions that are inside a transaction."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT state, query FROM pg_stat_activity "
            "WHERE application_name = %s AND xact_start IS NOT NULL",
            [app_name(worker)],
        )
        return cursor.fetchall()


def sessions(worker: str) -> list[tuple[str, str | None, str]]:
    """``(state, wait_event_type, query)`` of every database session of ``worker``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT state, wait_event_type, left(query, 120) FROM pg_stat_activity "
            "WHERE application_name = %s ORDER BY backend_start",
            [app_name(worker)],
        )
        return cursor.fetchall()


def freeze_between_transactions(workers: WorkerPool, name: str) -> None:
    """SIGSTOP ``name`` at a moment it holds no transaction open (retrying until so)."""
    worker = workers.workers[name]
    deadline = time.monotonic() + 10
    while True:
        worker.send(signal.SIGSTOP)
        time.sleep(0.02)  # let an in-flight statement reach the server
        if not open_transactions(name):
            return
        worker.send(signal.SIGCONT)
        assert time.monotonic() < deadline, f"{name} never idle\n{workers.logs()}"
        time.sleep(0.03)


def key_in_shard(prefix: str, shard: int) -> str:
    """An idempotency key that routes to ``shard``."""
    return next(
        f"{prefix}-{i}" for i in range(100_000) if shard_for(f"{prefix}-{i}", SHARDS) == shard
    )


def start_two_workers(workers: WorkerPool) -> None:
    workers.start("a")
    workers.wait_until(
        lambda: len(owned_by("a")) == SHARDS, timeout_s=30, what="a holding every shard"
    )
    workers.start("b")
    workers.wait_until(
        lambda: len(owned_by("a")) == len(owned_by("b")) == SHARDS // 2,
        timeout_s=30,
        what="a and b sharing the shards evenly",
        require_alive=["a", "b"],
    )


def test_frozen_worker_commits_no_fire_after_takeover(workers, record_property):
    start_two_workers(workers)
    # One schedule() per timer: each NOTIFY carries the id, so a's wheel holds them all
    # before it freezes, including the ones due while it is frozen and after it resumes.
    # 16 s of timers: the takeover alone may take LEASE_TTL_S after the freeze.
    count, step_ms = 400, 40
    first_due = now_ms() + 1_500
    with transaction.atomic():
        for i in range(count):
            when = datetime.fromtimestamp((first_due + i * step_ms) / 1000, tz=UTC)
            durable.schedule(probes.record, args=[f"fz{i}"], at=when)
    workers.wait_until(
        lambda: fired_count("fz") >= 20,
        timeout_s=20,
        what="the first timers firing",
        require_alive=["a", "b"],
    )

    freeze_between_transactions(workers, "a")
    frozen_ms = now_ms()
    old = dict(ShardLease.objects.filter(owner="a").values_list("shard", "token"))
    assert old, f"a held no shard when frozen\n{workers.logs()}"
    took = workers.wait_until(
        lambda: all(
            owner == "b" and token > old[shard]
            for shard, owner, token in ShardLease.objects.filter(shard__in=old).values_list(
                "shard", "owner", "token"
            )
        ),
        timeout_s=LEASE_TTL_S + 15,
        what="b taking over every shard of the frozen worker",
        require_alive=["b"],
    )
    metric(record_property, "takeover_after_sigstop_s", round(took, 2))
    workers.workers["a"].send(signal.SIGCONT)
    resumed_ms = now_ms()

    last_due = first_due + (count - 1) * step_ms
    assert resumed_ms < last_due - 1_000, "no timer left to come due after the resume"
    workers.wait_until(
        lambda: fired_count("fz") >= count and not Timer.objects.filter(state="pending").exists(),
        timeout_s=30,
        what=f"all {count} timers fired",
        require_alive=["a", "b"],
        explain=lambda: progress("fz"),
    )
    assert_exactly_once((f"fz{i}" for i in range(count)), "fz", workers)

    rows = list(
        Timer.objects.filter(shard__in=old).values_list("shard", "fire_at_ms", "fired_token")
    )
    while_frozen = [r for r in rows if frozen_ms <= r[1] < resumed_ms]
    after_resume = [r for r in rows if r[1] >= resumed_ms]
    assert while_frozen and after_resume, "no timer of a's shards came due in the test window"
    # a's stale token fires nothing due after it froze: it could only have fired those
    # by committing after the takeover (it was frozen in between).
    stale = [r for r in rows if r[2] == old[r[0]] and r[1] >= frozen_ms]
    assert not stale, f"fired under a's pre-freeze token: {stale[:10]}\n{workers.logs()}"
    assert all(token > old[shard] for shard, _, token in while_frozen + after_resume)
    lost = {
        int(line.split("shard=")[1].split()[0])
        for line in workers.workers["a"].events("lease.lost")
    }
    assert lost >= set(old), f"a did not notice losing {sorted(set(old) - lost)}\n{workers.logs()}"
    metric(record_property, "timers_due_while_frozen", len(while_frozen))
    metric(record_property, "timers_due_after_resume", len(after_resume))


def test_frozen_worker_cannot_complete_an_external_fire_after_takeover(
    workers, record_property, tmp_path
):
    """Frozen while an external handler runs (no transaction open): its completion is fenced."""
    start_two_workers(workers)
    shard = owned_by("a")[0]
    marker = tmp_path / "external-started"
    timer = durable.schedule(
        handlers.record_externally_slowly,
        args=["ext", str(marker), 1.5],
        key=key_in_shard("ext", shard),
    )
    workers.wait_until(marker.exists, timeout_s=15, what="the external handler starting in a")
    freeze_between_transactions(workers, "a")
    old = ShardLease.objects.get(shard=shard)
    assert old.owner == "a", workers.logs()
    took = workers.wait_until(
        lambda: ShardLease.objects.filter(shard=shard, owner="b", token__gt=old.token).exists(),
        timeout_s=LEASE_TTL_S + 15,
        what=f"b taking over shard {shard}",
        require_alive=["b"],
    )
    metric(record_property, "external_takeover_after_sigstop_s", round(took, 2))
    workers.workers["a"].send(signal.SIGCONT)

    worker_a = workers.workers["a"]
    workers.wait_until(
        lambda: any(
            f"timer={timer.pk} " in f"{line} " for line in worker_a.events("timer.complete_fenced")
        ),
        timeout_s=15,
        what="a's completion of the external fire being fenced",
        require_alive=["a", "b"],
        explain=lambda: Timer.objects.filter(pk=timer.pk).values().first(),
    )
    # Claimed by a, never completed under a's stale token. b re-ran the claim as soon as
    # it took the shard (claims belong to their token): its only attempt (max_attempts=1)
    # had started and never finished, so b dead-lettered it rather than run it again.
    workers.wait_until(
        lambda: Timer.objects.filter(pk=timer.pk, state="failed").exists(),
        timeout_s=15,
        what="b dead-lettering the claim a never completed",
        require_alive=["b"],
        explain=lambda: Timer.objects.filter(pk=timer.pk).values().first(),
    )
    row = Timer.objects.get(pk=timer.pk)
    assert row.fired_token is not None and row.fired_token > old.token, row.fired_token
    assert "AttemptsExhausted" in row.last_error, row.last_error
    assert fired_count("ext") == 1, "a's handler ran once; nobody ran it again"


def test_worker_frozen_inside_a_fire_does_not_stall_the_others(workers, record_property, tmp_path):
    """SIGSTOP while a handler runs: that shard's lease row stays locked, yet b must not stall.

    b keeps firing its own shards and takes a's other shards once their leases expire. (The
    locked shard itself can only move once a's session is gone; that is not asserted.)
    """
    start_two_workers(workers)
    shard = owned_by("a")[0]
    marker = tmp_path / "slow-started"
    durable.schedule(
        handlers.record_slowly,
        args=["slow", str(marker), 3.0],
        key=key_in_shard("slow", shard),
    )
    workers.wait_until(marker.exists, timeout_s=15, what="the slow handler starting in a")
    workers.workers["a"].send(signal.SIGSTOP)
    assert open_transactions("a"), "a is not inside its firing transaction"

    # b's own shards keep firing, and a's other shards move to b after the lease TTL.
    other = [s for s in owned_by("a") if s != shard]
    durable.schedule(
        probes.record,
        args=["b-side"],
        key=key_in_shard("b-side", owned_by("b")[0]),
        delay=timedelta(seconds=LEASE_TTL_S + 1),
    )
    took = workers.wait_until(
        lambda: fired_count("b-side") == 1 and set(owned_by("b")) >= set(other),
        timeout_s=LEASE_TTL_S + 6,
        what="b firing its own timer and taking a's other shards while a is frozen",
        require_alive=["b"],
        explain=lambda: (
            f"b fired b-side: {fired_count('b-side')}; b owns {owned_by('b')}\n"
            f"b's sessions: {sessions('b')}\na's sessions: {sessions('a')}"
        ),
    )
    metric(record_property, "frozen_in_transaction_takeover_s", round(took, 2))
