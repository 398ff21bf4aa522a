"""``RunGuard``: one replay per run per process, and no wake-up lost to a busy run."""

from __future__ import annotations

from durable.workflows.resume import RunGuard


def test_a_second_wake_up_while_busy_asks_for_one_more_round():
    guard = RunGuard()
    assert guard.enter("r1") is True
    assert guard.enter("r1") is False  # another thread fired a wake-up meanwhile
    assert guard.enter("r1") is False  # several collapse into one more round
    assert guard.enter("r2") is True  # other runs are independent
    assert guard.again("r1") is True
    assert guard.again("r1") is False  # nothing came during the second round: let go
    assert guard.enter("r1") is True


def test_leave_releases_a_run_after_an_error():
    guard = RunGuard()
    guard.enter("r1")
    guard.enter("r1")
    guard.leave("r1")
    assert guard.enter("r1") is True
