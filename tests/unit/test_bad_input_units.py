"""Issue 18's bad input, in the pure pieces: Backoff bounds, text and size checks, and
workflow ctx calls refused inside a run (replayed in memory, no database)."""

from __future__ import annotations

import inspect
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.test.utils import override_settings

import durable
from durable.core.backoff import MAX_BACKOFF_S, Backoff
from durable.exceptions import PayloadError
from durable.scheduling.validation import (
    MAX_INSTANT,
    MAX_INSTANT_MS,
    CallShape,
    call_shape,
    check_binds,
    check_delay,
    check_stored,
    check_text,
    fire_at_ms,
)
from durable.testing import ManualClock
from durable.workflows.memory import MemoryRun

# -- Backoff ----------------------------------------------------------------------------------


def test_no_attempt_number_makes_a_delay_longer_than_max_backoff():
    widest = Backoff(base_s=MAX_BACKOFF_S, max_s=MAX_BACKOFF_S)
    for attempt in (1, 2, 63, 64, 10**9, 10**30):
        assert 1 <= widest.delay_ms(attempt) <= MAX_BACKOFF_S * 1000
    assert Backoff(base_s=1, max_s=60).delay_ms(10**12) <= 60_000


@pytest.mark.parametrize("value", ["1", True, None])
def test_a_backoff_of_the_wrong_type_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"^backoff base_s: expected seconds"):
        Backoff(base_s=value)


def test_a_backoff_bound_is_365_days():
    assert Backoff(base_s=MAX_BACKOFF_S, max_s=MAX_BACKOFF_S).max_s == 365 * 86_400
    with pytest.raises(ValueError, match=r"^backoff max_s must be > 0 and <= 31,536,000 s"):
        Backoff(base_s=1, max_s=MAX_BACKOFF_S + 1)


# -- instants, text, binding, sizes -------------------------------------------------------------


def test_the_bound_converts_back_in_every_time_zone():
    assert datetime(9999, 12, 30, tzinfo=UTC) == MAX_INSTANT
    assert fire_at_ms(MAX_INSTANT, None, 0) == MAX_INSTANT_MS
    from zoneinfo import ZoneInfo

    for zone in ("Pacific/Kiritimati", "Etc/GMT+12", "UTC"):
        MAX_INSTANT.astimezone(ZoneInfo(zone))  # raises if it cannot


def test_delays_are_bounded_from_now():
    assert check_delay(timedelta(days=1), 0, "delay") == 86_400_000
    assert check_delay(timedelta(milliseconds=1), MAX_INSTANT_MS - 1, "delay") == 1
    with pytest.raises(
        ValueError, match=r"^delay: datetime.timedelta\(microseconds=2000\) is after"
    ):
        check_delay(timedelta(milliseconds=2), MAX_INSTANT_MS - 1, "delay")
    with pytest.raises(ValueError, match=r"^timeout: must be positive"):
        check_delay(timedelta(0), 0, "timeout", positive=True)
    with pytest.raises(ValueError, match=r"^delay: datetime.timedelta\(days=999999999"):
        check_delay(timedelta.max, 0, "delay")


@pytest.mark.parametrize("text", ["\x00", "ok\x00", "\ud800", "\udfff tail"])
def test_check_text_refuses_what_no_text_column_holds(text):
    with pytest.raises(ValueError, match=r"^specs\[2\]\.key: str contains"):
        check_text(text, "key", "specs[2]")


def test_check_text_passes_everything_else_through():
    for value in ("", "plain", "ünïcödé ✓ 🎉", None, 42):
        assert check_text(value, "name") == value


def test_check_binds_names_the_callee_and_what_did_not_bind():
    def handler(a: int, *, b: int = 0) -> None: ...

    shape = call_shape(handler)
    check_binds(shape, "handler h", [1], {"b": 2})
    check_binds(shape, "handler h", [1], {})
    with pytest.raises(TypeError, match=r"^args/kwargs: do not fit handler h\(a, \*, b=0\): "):
        check_binds(shape, "handler h", [1, 2], {})
    with pytest.raises(TypeError, match=r"missing a required argument: 'a'"):
        check_binds(shape, "handler h", [], {})
    check_binds(call_shape(len), "builtin", [[1]], {})  # a builtin with a signature
    check_binds(CallShape(None), "anything", [1, 2, 3], {"x": 1})  # unreadable: unchecked


def test_the_fast_path_agrees_with_bind():
    def f1(a, b=1, *args, c, **kw): ...
    def f2(a, /, b, *, c=3): ...
    def f3(*args): ...
    def f4(): ...

    for fn in (f1, f2, f3, f4):
        shape = call_shape(fn)
        for n in range(5):
            try:
                inspect.signature(fn).bind(*range(n))
                fits = True
            except TypeError:
                fits = False
            if fits:
                check_binds(shape, "f", list(range(n)), {})
            else:
                with pytest.raises(TypeError):
                    check_binds(shape, "f", list(range(n)), {})


def test_check_stored_counts_compact_utf8_json():
    check_stored("é" * 4, "result", 10, "MAX_RESULT_BYTES")  # 8 bytes + 2 quotes
    with pytest.raises(PayloadError, match=r"^result: 12 bytes of JSON; the limit is") as info:
        check_stored("é" * 5, "result", 10, "MAX_RESULT_BYTES")
    assert (info.value.size, info.value.limit, info.value.path) == (12, 10, "result")
    with pytest.raises(PayloadError, match=r"^result\[0\]: float inf is not JSON"):
        check_stored([float("inf")], "result", 10**6, "MAX_RESULT_BYTES")


# -- inside a workflow ---------------------------------------------------------------------------


@durable.workflow
def refusals(ctx: Any) -> list[str]:
    """Makes each bad ctx call and collects the errors."""
    calls = [
        lambda: ctx.sleep(timedelta.max),
        lambda: ctx.sleep(timedelta(days=3_652_500)),
        lambda: ctx.sleep_until(datetime.max.replace(tzinfo=UTC)),
        lambda: ctx.wait_for_signal("go", timeout=timedelta.max),
        lambda: ctx.wait_for_signal("a\x00"),
        lambda: ctx.options(name="step\ud800"),
        lambda: ctx.options(max_attempts=2**40),
        lambda: ctx.patched("fix\x00"),
    ]
    errors = []
    for call in calls:
        try:
            call()
        except (TypeError, ValueError) as exc:
            errors.append(str(exc).split(":")[0])
    return errors


def test_bad_ctx_calls_raise_into_the_workflow_naming_the_argument():
    run = MemoryRun(refusals, clock=ManualClock(start_ms=1_900_000_000_000))
    outcome = run.resume()
    assert outcome.state == "completed"
    assert outcome.result == [
        "delay",
        "delay",
        "when",
        "timeout",
        "name",
        "name",
        "max_attempts",
        "change_id",
    ]
    assert run.history == []  # nothing was recorded


@durable.workflow
def counts(ctx: Any, n: int) -> int:
    """Takes ``n`` recorded values."""
    return sum(int(ctx.random() >= 0) for _ in range(n))


def test_the_call_past_max_steps_per_run_fails_the_run():
    clock = ManualClock(start_ms=0)
    with override_settings(DURABLE={"MAX_STEPS_PER_RUN": 3}):
        assert MemoryRun(counts, 3, clock=clock).resume().result == 3
        run = MemoryRun(counts, 4, clock=clock)
        outcome = run.resume()
    assert outcome.state == "failed" and len(run.history) == 3
    assert str(outcome.error).startswith("ctx call number 4 exceeds DURABLE['MAX_STEPS_PER_RUN']")
    assert (outcome.error.seq, outcome.error.limit) == (3, 3)


def test_a_step_result_past_max_result_bytes_fails_the_step_in_memory():
    @durable.workflow(name="tests.unit.big_step")
    def big(ctx: Any, n: int) -> Any:
        return ctx.step(lambda: "x" * n)

    with override_settings(DURABLE={"MAX_RESULT_BYTES": 100}):
        assert MemoryRun(big, 98, clock=ManualClock(start_ms=0)).resume().state == "completed"
        outcome = MemoryRun(big, 99, clock=ManualClock(start_ms=0)).resume()
    assert outcome.state == "failed"
    assert "result: 101 bytes of JSON; the limit is DURABLE['MAX_RESULT_BYTES'] = 100" in str(
        outcome.error
    )
