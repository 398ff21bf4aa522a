"""``RunGuard``: one replay per run per process, and no wake-up lost to a busy run."""

from __future__ import annotations

from durable.storage.checkpoints import RunSnapshot
from durable.workflows.runguard import Handovers, RunGuard


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


def _snapshot(run_id: str) -> RunSnapshot:
    return RunSnapshot(id=run_id, name="w", shard=0, args=[], kwargs={}, model_label="",
                       object_pk="", parent_id=None, steps=[])  # fmt: skip


def test_a_handover_is_used_only_once_its_batch_committed():
    handovers = Handovers()
    token = handovers.offer({"r1": _snapshot("r1"), "r2": _snapshot("r2")})
    assert handovers.take("r1") is None  # taken before the commit: dropped, read it yourself
    handovers.confirm(["r1", "r2"], token)
    assert handovers.take("r1") is None  # gone: the first replay to start took it
    assert handovers.take("r2").id == "r2"
    assert handovers.take("r2") is None  # one replay only


def test_a_newer_offer_replaces_an_older_one_and_discard_drops_it():
    handovers = Handovers()
    old = handovers.offer({"r1": _snapshot("r1")})
    new = handovers.offer({"r1": _snapshot("r1")})
    handovers.confirm(["r1"], old)  # the older batch's confirmation does not count
    assert handovers.take("r1") is None
    handovers.offer({"r1": _snapshot("r1")})
    handovers.discard("r1")  # the run ended inside a later batch
    handovers.confirm(["r1"], new)
    assert handovers.take("r1") is None
