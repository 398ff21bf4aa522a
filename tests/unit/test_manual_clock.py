from datetime import UTC, datetime, timedelta

import pytest

from durable.core.clock import SystemClock
from durable.testing import ManualClock


def test_manual_clock_moves_only_when_told():
    clock = ManualClock(start_ms=1_000)
    assert clock.now_ms() == 1_000
    assert clock.advance(timedelta(seconds=2)) == 3_000
    assert clock.advance(5) == 3_005
    clock.set(datetime(2030, 1, 1, tzinfo=UTC))
    assert clock.now_ms() == 1_893_456_000_000


def test_manual_clock_rejects_naive_and_backwards():
    clock = ManualClock(start_ms=10)
    with pytest.raises(ValueError, match="naive"):
        clock.set(datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="backwards"):
        clock.set(5)
    with pytest.raises(ValueError, match="non-negative"):
        clock.advance(-1)


def test_system_clock_applies_offset():
    base = SystemClock().now_ms()
    shifted = SystemClock(offset_ms=60_000).now_ms()
    assert 59_000 <= shifted - base <= 61_000
