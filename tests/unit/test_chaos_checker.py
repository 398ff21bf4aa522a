"""The chaos run's checker catches every kind of broken promise (no database, no workers).

A small hand-made history that keeps every promise passes; each test then breaks one
promise the way a bug would (a second fire, an early one, a lost one, ...) and the
checker must name that invariant and the ids involved.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from chaos.celery_check import CELERY_INVARIANTS
from chaos.checker import INVARIANTS, Bounds, History, check

END = 100_000


def ok_op(kind: str, op: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "op": op, "status": "committed", "t0": 0, "t1": 10, **fields}


def timer(id_: int, op: str, state: str = "fired", **fields: Any) -> dict[str, Any]:
    row = {"id": id_, "state": state, "target": "testproject.demo.chaos.atomic", "args": [op]}
    return {"attempts": 1, "max_attempts": 5, "fire_at_ms": 1000, "key": None, **row, **fields}


def clean() -> History:
    """Every promise kept: atomic, external, rolled back, cancelled, keyed, follow-up,
    workflow, schedule and poison work."""
    result = {"op": "w6", "total": 4, "signal": "p-w6", "child": "w6:kid"}  # 0+1 + 1+2
    return History(
        ops=[
            ok_op("timer", "t1", handler="atomic", due_ms=1000, timer_id=1),
            ok_op("timer", "t2", handler="external", due_ms=1000, timer_id=2),
            ok_op("timer", "t3", handler="atomic", due_ms=1000, status="rolled_back"),
            ok_op("timer", "t4", handler="atomic", due_ms=1500, timer_id=4),
            ok_op("cancel", "t4", timer_id=4, result=True, t1=1200),
            ok_op("timer", "t5", handler="atomic", due_ms=1000, timer_id=5, on_complete=True),
            ok_op("dup", "t1-dup", of="t1", timer_id=1, again_id=1),
            ok_op("workflow", "w6", steps=2, sleep_ms=500, signal=True, child=True),
            ok_op("cron", "", name="c", first_ms=0, interval_ms=1000),
            ok_op("poison", "p7", handler="atomic_poison", poison="SystemExit", timer_id=7),
            ok_op("timer", "t8", handler="atomic", due_ms=6000, timer_id=8),
            ok_op("timer", "t9", handler="atomic", due_ms=5000, timer_id=9, parent_op="t8"),
            ok_op("cancel", "t8", timer_id=8, result=True, t1=2000),
        ],
        ledger=[
            ("t1", 1100, 1000),
            ("t2", 1200, 1000),
            ("t2", 1300, 1000),  # external: at least once, a second run is allowed
            ("t5", 1100, 1000),
            ("t5:oc:success", 1150, None),
            ("w6:step0", 2000, None),
            ("w6:atomic0", 2010, None),
            ("w6:step1", 2020, None),
            ("w6:step1", 2025, None),  # an outside step may run again
            ("w6:atomic1", 2030, None),
            ("w6:woke", 2600, 2530),
            ("w6:signal:p-w6", 2700, None),
            ("w6:kid", 2800, None),
            ("cron:c:0", 10, 0),
            ("cron:c:2000", 2010, 2000),
        ],
        timers=[
            timer(1, "t1"),
            timer(2, "t2", target="testproject.demo.chaos.external"),
            timer(4, "t4", "canceled", fire_at_ms=1500),
            timer(5, "t5"),
            timer(7, "SystemExit", "failed", attempts=2, max_attempts=2),
            timer(8, "t8", "canceled", fire_at_ms=6000),
            timer(9, "t9", "canceled", fire_at_ms=5000),
        ],
        runs=[
            {"id": "w6", "name": "flow", "state": "completed", "result": result},
            {"id": "w6-kid", "name": "kid_flow", "state": "completed", "result": "w6:kid"},
        ],
        schedules=[{"name": "c", "next_ms": 3000, "skipped_count": 1}],  # 1000 skipped
        end_ms=END,
    )


def flagged(history: History) -> dict[str, list[str]]:
    return {name: found for name, found in check(history).violations.items() if found}


def test_a_history_that_keeps_every_promise_passes_and_each_invariant_looked_at_something():
    verdict = check(clean())
    assert verdict.ok, verdict.violations
    assert set(verdict.violations) == set(INVARIANTS)
    looked = [name for name in INVARIANTS if verdict.checked[name] or name in CELERY_INVARIANTS]
    assert looked == list(INVARIANTS)  # the Celery ones: tests/unit/test_chaos_celery_check.py
    assert verdict.ops["timer"] == 6 and verdict.ops["timer:rolled_back"] == 1


def broken(change) -> History:
    history = copy.deepcopy(clean())
    change(history)
    return history


def rows(history: History, op: str) -> list[dict[str, Any]]:
    return [t for t in history.timers if t["args"] == [op]]


@pytest.mark.parametrize(
    ("invariant", "change", "names"),
    [
        ("atomic_exactly_once", lambda h: h.ledger.append(("t1", 1150, 1000)), "t1"),
        (
            "external_at_least_once",
            lambda h: h.ledger.__setitem__(slice(None), [r for r in h.ledger if r[0] != "t2"]),
            "t2",
        ),
        ("never_lost", lambda h: rows(h, "t1")[0].update(state="pending"), "t1"),
        ("never_early", lambda h: h.ledger.__setitem__(0, ("t1", 999, 1000)), "t1"),
        ("never_early", lambda h: h.ledger.append(("cron:c:1000", 990, 1000)), "cron:c:1000"),
        (
            "never_early",  # a committed reschedule moved the due time later
            lambda h: h.ops.append(ok_op("reschedule", "t1", result=True, due_ms=3000)),
            "t1",
        ),
        ("rolled_back_never_fired", lambda h: h.ledger.append(("t3", 1100, 1000)), "t3"),
        (
            "rolled_back_never_fired",
            lambda h: (
                h.ops.append(
                    ok_op(
                        "workflow",
                        "w66",
                        status="rolled_back",
                        steps=1,
                        sleep_ms=0,
                        signal=False,
                        child=False,
                    )
                )
                or h.ledger.append(("w66:atomic0", 10, None))
            ),
            "w66",
        ),
        (
            "cancelled_never_fired",
            lambda h: h.ledger.append(("t4", 1600, 1500)) or rows(h, "t4")[0].update(state="fired"),
            "t4",
        ),
        (
            "cancelled_never_fired",  # the cascade missed a pending child
            lambda h: h.ledger.append(("t9", 5000, 5000)) or rows(h, "t9")[0].update(state="fired"),
            "t9",
        ),
        ("key_scheduled_once", lambda h: h.ops[6].update(again_id=99), "t1-dup"),
        ("key_scheduled_once", lambda h: h.ledger.append(("t1-dup", 1100, 1000)), "t1-dup"),
        ("on_complete_once", lambda h: h.ledger.append(("t5:oc:success", 1160, None)), "t5"),
        ("on_complete_once", lambda h: h.ledger.remove(("t5:oc:success", 1150, None)), "t5"),
        ("workflow_completed_right", lambda h: h.runs[0]["result"].update(total=5), "w6"),
        ("workflow_completed_right", lambda h: h.runs[0].update(state="failed"), "w6"),
        ("workflow_atomic_once", lambda h: h.ledger.append(("w6:atomic1", 2040, None)), "w6"),
        ("workflow_atomic_once", lambda h: h.ledger.remove(("w6:kid", 2800, None)), "w6"),
        ("workflow_atomic_once", lambda h: h.ledger.remove(("w6:step0", 2000, None)), "w6"),
        ("signal_consumed_once", lambda h: h.ledger.append(("w6:signal:p-w6", 2710, None)), "w6"),
        ("cron_occurrence_once", lambda h: h.ledger.append(("cron:c:2000", 2020, 2000)), "c"),
        ("cron_occurrence_once", lambda h: h.schedules[0].update(skipped_count=0), "c"),
        ("poison_dead_lettered", lambda h: h.timers[4].update(state="fired"), "p7"),
        ("poison_dead_lettered", lambda h: h.timers[4].update(attempts=3), "p7"),
        ("nothing_stuck", lambda h: h.timers.append(timer(50, "t50", "firing")), "timer 50"),
        ("nothing_stuck", lambda h: h.timers.append(timer(51, "t51", "pending")), "timer 51"),
        ("nothing_stuck", lambda h: h.runs[1].update(state="running"), "w6-kid"),
        ("lateness_within_bound", lambda h: h.ledger.__setitem__(0, ("t1", 9000, 1000)), "t1"),
    ],
)
def test_each_broken_promise_is_caught_and_named(invariant, change, names):
    found = flagged(broken(change))
    assert invariant in found, found
    assert any(names in message for message in found[invariant]), found[invariant]


def test_a_commit_in_doubt_may_have_fired_once_but_not_twice():
    def in_doubt(h: History) -> None:
        h.ops[0]["status"] = "unknown"

    assert check(broken(in_doubt)).ok
    twice = broken(lambda h: in_doubt(h) or h.ledger.append(("t1", 1150, 1000)))
    assert "atomic_exactly_once" in flagged(twice)


def test_lateness_is_allowed_the_documented_recovery_after_a_fault_and_no_more():
    bounds = Bounds()  # LEASE_TTL_S 10 s: a SIGKILL allows 12 s from the kill
    kill = {"kind": "kill", "start_ms": 2000, "end_ms": 2000, "target": "w1"}

    def late_by(fired: int) -> History:
        def change(h: History) -> None:
            h.faults.append(kill)
            h.ledger[0] = ("t1", fired, 1000)

        return broken(change)

    within = check(late_by(2000 + 12_000))
    assert within.ok, within.violations
    assert within.lateness["kill"] == 12_000
    beyond = flagged(late_by(2000 + 12_001))
    assert "kill@2000" in beyond["lateness_within_bound"][0]
    # Without a fault, the healthy bound applies (two rescans + batch budget + 1 s).
    assert bounds.healthy_ms == 7_000
    healthy = broken(lambda h: h.ledger.__setitem__(0, ("t1", 1000 + 7_000, 1000)))
    assert check(healthy).ok
    late = broken(lambda h: h.ledger.__setitem__(0, ("t1", 1000 + 7_001, 1000)))
    assert "no fault" in flagged(late)["lateness_within_bound"][0]


def test_a_stop_allows_its_own_length_up_to_the_frozen_transaction_timeout():
    bounds = Bounds()  # a frozen loop's transaction is aborted after 2 x LEASE_TTL_S
    short = {"kind": "stop", "start_ms": 0, "end_ms": 3000}
    long = {"kind": "stop", "start_ms": 0, "end_ms": 60_000}
    assert bounds.after(short) == 5000
    assert bounds.after(long) == 22_000


def test_a_fault_that_began_after_the_fire_was_due_explains_none_of_its_lateness():
    def change(h: History) -> None:
        h.faults.append({"kind": "terminate", "start_ms": 38_000, "end_ms": 38_000})
        h.ledger[0] = ("t1", 40_000, 1000)

    found = flagged(broken(change))["lateness_within_bound"]
    assert "t1: due 1000, fired 40000" in found[0] and "no fault" in found[0]


def test_a_hanging_atomic_poison_excuses_the_fires_its_worker_held_up():
    def change(h: History) -> None:
        h.ops.append(
            ok_op("poison", "p9", handler="atomic_poison", poison="hang", timer_id=9, due_ms=500)
        )
        h.timers.append(timer(99, "hang", "failed", attempts=2, max_attempts=2, updated_ms=20_000))
        h.ops[-1]["timer_id"] = 99
        h.ops[0]["due_ms"] = 10_000  # due while the poison held the loop
        h.ledger[0] = ("t1", 21_000, 10_000)

    h = broken(change)
    verdict = check(h)
    assert verdict.ok, verdict.violations
    assert verdict.lateness["poison_hang"] == 1_000, "counted from its dead letter"
    h.ops.pop()  # without the poison, nothing explains 11 s
    assert "lateness_within_bound" in flagged(h)


def test_lateness_can_be_reported_without_failing_the_run_and_nothing_else_can():
    late = broken(lambda h: h.ledger.__setitem__(0, ("t1", 9000, 1000)))
    verdict = check(late, report_only=frozenset({"lateness_within_bound"}))
    assert verdict.ok and verdict.violations["lateness_within_bound"]
    twice = broken(lambda h: h.ledger.append(("t1", 9000, 1000)))
    assert not check(twice, report_only=frozenset({"lateness_within_bound"})).ok


def test_a_fault_during_the_recovery_from_another_starts_the_recovery_over():
    # A freeze from 0 to 8 s allows the fire due at 1 s until 2 s after SIGCONT (10 s);
    # a lock taken at 9.5 s, during that recovery, held to 12 s, allows 9 s more after
    # its release (21 s): a bound counts from the end of the last fault that held it up.
    stop = {"kind": "stop", "start_ms": 0, "end_ms": 8000, "target": "w1"}

    def late(lock_at: int, fired: int) -> History:
        def change(h: History) -> None:
            h.faults += [stop, {"kind": "lock", "start_ms": lock_at, "end_ms": 12_000}]
            h.ledger[0] = ("t1", fired, 1000)

        return broken(change)

    chained = check(late(9500, 21_000))
    assert chained.ok, chained.violations
    assert chained.lateness["lock"] == 21_000 - 12_000, "counted from the lock's release"
    assert chained.chained == 1, "counted apart: the stop alone allows 10 s"
    assert "lateness_within_bound" in flagged(late(9500, 21_001))
    # A lock taken after the recovery was due (10 s) explains nothing of the lateness.
    found = flagged(late(10_001, 20_000))["lateness_within_bound"]
    assert "lock@" not in found[0] and "stop@0" in found[0]


def test_holds_read_from_the_worker_logs_chain_where_the_estimate_broke():
    # Seed 20261202: three hanging atomic poisons held one worker's loop in turn (40
    # twice, then 41, 42, 41 again) and a fire due during the first hold came when the
    # last ended. Estimated from the rows (attempts x timeout before the dead letter),
    # 41's holds begin after 40's recovery was over and the chain breaks: the fire
    # looked late. Read from the log, the holds chain.
    import time as _time

    from chaos.lateness import holds_from_logs

    def line(at_s: int, timer_id: int, attempt: int, target: str = "atomic_poison") -> str:
        stamp = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(at_s))
        return (
            f"{stamp},000 WARNING durable.worker timer.error timer={timer_id} "
            f"target=testproject.demo.poison.{target} attempt={attempt} error="
            "HandlerTimeout: the handler ran past its timeout of 5 s and was interrupted\n"
        )

    base = 1_800_000_000
    ends = [(5, 40, 1), (10, 40, 2), (15, 41, 1), (20, 42, 1), (25, 41, 2)]
    log = [line(base + at, id_, n) for at, id_, n in ends]
    log.append(line(base + 16, 43, 1, "external_poison"))  # not on the loop: no hold
    holds = holds_from_logs(log, "w2", {"testproject.demo.poison.atomic_poison"})
    assert [(h["start_ms"] - base * 1000, h["end_ms"] - base * 1000) for h in holds] == [
        (at * 1000 - 5500, at * 1000) for at, _, _ in ends
    ], "each hold ends at its line and began its timeout (and a little) before"
    assert [h["timer_id"] for h in holds] == [40, 40, 41, 42, 41]

    def change(h: History) -> None:
        for id_, last_s in ((40, 10), (41, 25), (42, 30)):  # 42's second: another worker
            h.ops.append(ok_op("poison", f"p{id_}", handler="atomic_poison", poison="hang"))
            h.ops[-1].update(timer_id=id_, due_ms=base * 1000)
            row = timer(id_, "hang", "failed", attempts=2, max_attempts=2)
            h.timers.append({**row, "updated_ms": (base + last_s) * 1000})
        h.ops[0]["due_ms"] = base * 1000 + 1000  # due during the first hold
        h.ledger[0] = ("t1", base * 1000 + 26_500, base * 1000 + 1000)

    estimated = broken(change)
    assert "lateness_within_bound" in flagged(estimated), "the estimate breaks the chain"
    logged = broken(change)
    logged.holds = holds  # (42's second hold, on another worker, came after the fire)
    verdict = check(logged)
    assert verdict.ok, verdict.violations
    assert verdict.lateness["poison_hang"] == 1_500, "from the end of the last hold"


def test_a_retry_after_a_failed_attempt_is_late_only_from_its_own_due_time():
    # Seed 20261202: an external handler's own session was terminated (attempt 1 failed),
    # then its worker froze: its retry came 20 s after the first due time, which is its
    # backoff after the failure, by design, then the recovery from what struck next.
    import time as _time

    from chaos.lateness import retries_from_logs

    base = 1_800_000_000
    stamp = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(base + 20))
    line = (
        f"{stamp},250 WARNING durable.worker timer.error timer=1 target=testproject.demo."
        "chaos.atomic attempt=2 error=OperationalError: terminating connection due to ...\n"
    )
    retries = retries_from_logs(["noise\n", line])
    assert retries == {1: [(base * 1000 + 20_250, base * 1000 + 22_250)]}, "backoff 2 s"

    def fired_at(ms: int) -> History:
        def change(h: History) -> None:
            h.ops[0]["due_ms"] = base * 1000
            h.ledger[0] = ("t1", base * 1000 + ms, base * 1000)

        return broken(change)

    late = fired_at(29_000)  # 29 s after its first due time, no fault near
    assert "lateness_within_bound" in flagged(late)
    late.retries = retries
    assert check(late).ok, "7 s after its retry was due: the healthy bound"
    later = fired_at(29_251)
    later.retries = retries
    assert "lateness_within_bound" in flagged(later)
    early = fired_at(21_000)  # retried before its longest backoff: not late at all
    early.retries = retries
    assert check(early).lateness["none"] < 1000, "the other fires' 200 ms is the worst"


def test_hanging_external_handlers_that_hold_every_handler_thread_excuse_the_wait():
    # Seed 20261203: four hanging external poisons held all four of w2's handler threads
    # (2 s, twice each: their retries hung again); the worker parks its due external
    # timers until a thread is free (docs/how-to/run-the-worker.md), so an external
    # timer due meanwhile waited 4 s and more, by design.
    import time as _time

    from chaos.lateness import thread_holds_from_logs

    def line(at_ms: int, timer_id: int, attempt: int) -> str:
        stamp = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(at_ms // 1000))
        return (
            f"{stamp},{at_ms % 1000:03d} ERROR durable.worker timer.timeout timer={timer_id} "
            f"target=testproject.demo.poison.external_poison attempt={attempt} timeout_s=2.0\n"
        )

    base = 1_800_000_000_000
    # Each hang's line comes when the loop abandoned it, 2 s after it began (or later).
    # Four rounds of four hangs 2.15 s apart (a round's retries begin as the last ends).
    rounds = [2_150 * r for r in range(4)]
    ends = [(o + at, r + 1) for r, o in enumerate(rounds) for at in (2_000, 2_100, 2_200, 2_300)]
    log = ["noise\n"] + [line(base + at, 40 + i % 4, n) for i, (at, n) in enumerate(ends)]
    log.append(line(base + 12_000, 50, 1))  # one alone later: three threads stay free
    held = thread_holds_from_logs(log, "w2", threads=4)
    assert [(h["start_ms"] - base, h["end_ms"] - base) for h in held] == [
        (o + 300, o + 2_000) for o in rounds
    ], "only while all four threads hang"
    assert thread_holds_from_logs(log, "w2", threads=5) == [], "a thread was always free"

    def change(h: History) -> None:  # t2 (external) due at 500, fired 1.55 s after the holds
        h.ops[1]["due_ms"] = base + 500
        h.ledger[1] = ("t2", base + 10_000, base + 500)
        h.ledger[2] = ("t2", base + 10_100, base + 500)

    assert "lateness_within_bound" in flagged(broken(change)), "with no hold, it is late"
    excused = broken(change)
    excused.holds = held
    verdict = check(excused)
    assert verdict.ok, verdict.violations
    assert verdict.lateness["threads_held"] == 1_550, "from the end of the last hold"
