"""Atomic handlers' deadlines with ``SIGALRM`` taken once per batch (issue 16).

The interval timer is set only when it would ring later than the running call's
deadline, and an alarm that rings early (set for an earlier call) is set again for what
is left of the running call: each call is still interrupted at its own deadline, and an
alarm between calls interrupts nothing. pytest runs tests on the main thread, where the
worker's loop runs under ``run_timer_shards``.
"""

from __future__ import annotations

import signal
import time

import pytest

from durable.exceptions import HandlerTimeout
from durable.worker.deadline import Deadlines


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _timed_out(deadlines: Deadlines, timeout_s: float, runs_s: float) -> float | None:
    """Run a call of ``runs_s`` under ``timeout_s``; the seconds until it was
    interrupted, or None if it was not."""
    started = time.monotonic()
    deadlines.start(timeout_s)
    try:
        _busy(runs_s)
    except HandlerTimeout:
        return time.monotonic() - started
    finally:
        deadlines.stop()
    return None


def test_a_short_limit_after_a_longer_one_is_kept():
    deadlines = Deadlines()
    with deadlines.batch():
        assert _timed_out(deadlines, 5.0, 0.0) is None  # the timer is set for 5 s
        took = _timed_out(deadlines, 0.2, 3.0)
    assert took is not None and 0.15 <= took < 1.0, took


def test_an_alarm_set_for_an_earlier_call_does_not_cut_the_next_one_short():
    deadlines = Deadlines()
    with deadlines.batch():
        assert _timed_out(deadlines, 0.2, 0.0) is None  # the timer rings in 0.2 s
        took = _timed_out(deadlines, 0.6, 3.0)
    assert took is not None and 0.55 <= took < 1.5, took


def test_an_alarm_between_calls_interrupts_nothing():
    deadlines = Deadlines()
    with deadlines.batch():
        assert _timed_out(deadlines, 0.05, 0.0) is None
        _busy(0.2)  # the firer's bookkeeping, after the call: the alarm rings here
        assert _timed_out(deadlines, 1.0, 0.05) is None


def test_every_call_of_a_batch_gets_its_own_full_time():
    deadlines = Deadlines()
    with deadlines.batch():
        for _ in range(4):  # 4 x 0.15 s: past the first call's deadline of 0.3 s
            assert _timed_out(deadlines, 0.3, 0.15) is None


def test_the_previous_alarm_comes_back_after_the_batch():
    rang: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: rang.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        deadlines = Deadlines()
        with deadlines.batch():
            assert _timed_out(deadlines, 0.1, 0.0) is None
            _busy(0.2)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0.1 < left <= 0.35, left
        _busy(0.5)
        assert rang == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("timeout", [None, 0, float("inf")])
def test_no_limit_sets_no_timer(timeout):
    deadlines = Deadlines()
    with deadlines.batch():
        deadlines.start(timeout)
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        deadlines.stop()
