"""Handlers, workflows and schedule functions the chaos run (``make chaos``) fires.

Every effect writes a ``FireRecord`` ledger row whose ``key`` names the load
generator's operation (``<op>`` for a timer, ``<op>:atomic<i>`` for a workflow's atomic
step, ...), ``fired_at_ms`` the database server's clock when the effect ran and
``due_at_ms`` when it was due, so the checker (``chaos/checker.py``) can prove
exactly-once, at-least-once and never-early from the ledger alone. The database clock
is the one the worker fires by, which is why it stamps the ledger.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.db import connections

import durable
from durable.conf import get_settings
from durable.dispatch.context import current_fire
from durable.scheduling.cron import Occurrence
from testproject.demo.models import FireRecord

#: Retry quickly: the chaos run is short and its checker waits for every retry.
FAST = durable.Backoff(base_s=0.2, max_s=0.5)


def db_now_ms() -> int:
    """The database server's clock, in epoch ms (``clock_timestamp()``, not the txn's)."""
    with connections[get_settings().DATABASE].cursor() as cursor:
        cursor.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
        return int(cursor.fetchone()[0])


def ledger(key: str, due_ms: int | None = None) -> None:
    """Write one ledger row for ``key``, stamped with the database clock."""
    FireRecord.objects.create(key=key, fired_at_ms=db_now_ms(), due_at_ms=due_ms)


def _due() -> int | None:
    ctx = current_fire()
    return ctx.scheduled_ms if ctx else None


@durable.handler
def atomic(op: str) -> str:
    """Atomic: the ledger row commits with the fire, so there is exactly one."""
    ledger(op, _due())
    return op


@durable.handler(atomic=False)
def external(op: str) -> str:
    """External (at least once): the ledger row commits on its own, before completion."""
    ledger(op, _due())
    return op


@durable.handler(max_attempts=5, backoff=FAST)
def flaky(op: str, fail_times: int) -> str:
    """Atomic, failing its first ``fail_times`` (at most 2) attempts (their rows roll back).

    Five attempts: an attempt is counted before it runs, so one cut short by a fault (its
    worker killed or frozen) is spent too; two spare ones keep a planned failure from
    turning into a dead letter when a fault strikes as well.
    """
    ctx = current_fire()
    if ctx is not None and ctx.attempt <= fail_times:
        ledger(f"{op}:failed{ctx.attempt}", _due())  # rolled back with the attempt
        raise RuntimeError(f"chaos: planned failure of attempt {ctx.attempt}")
    ledger(op, _due())
    return op


@durable.handler
def after(timer_id: int, context: Any, result: dict[str, Any]) -> None:
    """``on_complete`` follow-up: one row ``<op>:oc:<status>`` per finished timer."""
    ledger(f"{context}:oc:{result.get('status')}")


@durable.handler
def tick(occurrence: Occurrence) -> None:
    """A schedule's run: one row ``cron:<schedule>:<occurrence ms>`` per occurrence."""
    ledger(f"cron:{occurrence.schedule}:{occurrence.scheduled_ms}", occurrence.scheduled_ms)


# --- workflows ---------------------------------------------------------------------------


def outside(op: str, i: int) -> int:
    """An outside step (at least once): its row commits before the step's record."""
    ledger(f"{op}:step{i}")
    return i * i


def inside(op: str, i: int) -> int:
    """An atomic step: its row commits with the step's record (exactly once)."""
    ledger(f"{op}:atomic{i}")
    return i + 1


def woke(op: str, due_ms: int) -> None:
    """After a durable sleep: when it woke (never before ``due_ms``)."""
    ledger(f"{op}:woke", due_ms)


def took_signal(op: str, payload: Any) -> None:
    """The signal's payload was consumed (exactly once)."""
    ledger(f"{op}:signal:{payload}")


def expected_result(op: str, steps: int, signal: Any, child: bool) -> dict[str, Any]:
    """What :func:`flow` returns for these arguments (the checker compares)."""
    total = sum(i * i + i + 1 for i in range(steps))
    return {"op": op, "total": total, "signal": signal, "child": f"{op}:kid" if child else None}


@durable.workflow
def flow(
    ctx: durable.WorkflowContext, op: str, steps: int, sleep_ms: int, signal: bool, child: bool
) -> dict[str, Any]:
    """Steps (outside and atomic), a durable sleep, a signal wait and a child run."""
    total = 0
    for i in range(steps):
        total += ctx.step(outside, op, i)
        total += ctx.atomic(inside, op, i)
    if sleep_ms:
        start_ms = int(ctx.now().timestamp() * 1000)
        ctx.sleep(timedelta(milliseconds=sleep_ms))
        ctx.atomic(woke, op, start_ms + sleep_ms)
    payload = None
    if signal:
        payload = ctx.wait_for_signal("go")
        ctx.atomic(took_signal, op, payload)
    kid = ctx.child(kid_flow, op) if child else None
    return {"op": op, "total": total, "signal": payload, "child": kid}


def kid_done(op: str) -> str:
    """The child's only effect (exactly once)."""
    ledger(f"{op}:kid")
    return f"{op}:kid"


@durable.workflow
def kid_flow(ctx: durable.WorkflowContext, op: str) -> str:
    """A child run: one atomic step."""
    return str(ctx.atomic(kid_done, op))


@durable.handler(atomic=False, max_attempts=2)
def drop_own_session(key: str, refuse_new: bool = False) -> str:
    """External: records ``key``, then its database session is terminated (as the chaos
    run's nemesis does), so the worker completes the timer on a broken connection.

    ``refuse_new``: first set the database's connection limit to 0 (its owner may), as a
    restarting server refuses connections; the test that asks for it lifts it again.
    """
    from django.db import DatabaseError

    ledger(key, _due())
    try:
        with connections[get_settings().DATABASE].cursor() as cursor:
            if refuse_new:
                cursor.execute("SELECT current_database()")
                name = cursor.fetchone()[0].replace('"', '""')
                cursor.execute(f'ALTER DATABASE "{name}" CONNECTION LIMIT 0')
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    except DatabaseError:
        pass  # the session is gone: what the worker does next is under test
    return key


#: Keys :func:`drop_batch_session` has already dropped its session for (this process).
DROPPED: set[str] = set()


@durable.handler(max_attempts=1)
def drop_batch_session(key: str, every_time: bool = False) -> str:
    """Atomic: records ``key``, then terminates the worker's session (the batch's), as
    the nemesis's ``pg_terminate_backend`` does, and returns as if nothing happened: the
    batch's transaction is lost with every handler's effects in it. Once per ``key`` in
    a process, or ``every_time`` (then a poison: it breaks its own batch each time).
    """
    from django.db import DatabaseError

    ledger(key, _due())
    if every_time or key not in DROPPED:
        DROPPED.add(key)
        try:
            with connections[get_settings().DATABASE].cursor() as cursor:
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        except DatabaseError:
            pass  # the session is gone: what the worker does next is under test
    return key
