"""Raft's side of the leases on the database: a leader takes a shard at once, the old
owner is fenced, shards a peer leads are given up, and the published view reaches
``durable_status``. Raft itself is a stand-in here (the groups are tested with real
processes in tests/acceptance/test_raft_failover.py); the database is real."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import transaction

import durable
from durable.exceptions import LeaseLost
from durable.models import ShardLease, Timer
from durable.storage import leases
from durable.storage import status as status_store
from durable.worker import raftlink
from durable.worker.engine import Engine
from testproject.demo import probes

START_MS = 1_900_000_000_000
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def row(shard: int) -> tuple[str, int, int]:
    lease = ShardLease.objects.get(shard=shard)
    return lease.owner, lease.token, lease.raft_term


def test_a_leader_with_a_newer_term_takes_a_live_lease_at_once():
    leases.ensure_shards("default", 2)
    assert leases.acquire_as_leader("default", {0: 3}, "a", START_MS, 10) == {0: 1}
    assert row(0) == ("a", 1, 3)
    # Same term, lease live: nobody takes it before it expires.
    assert leases.acquire_as_leader("default", {0: 3}, "b", START_MS + 1000, 10) == {}
    assert leases.acquire("default", 0, "c", START_MS + 1000, 10) is None
    # A newer term: at once, with a new token.
    assert leases.acquire_as_leader("default", {0: 4, 1: 4}, "b", START_MS + 1000, 10) == {
        0: 2,
        1: 1,
    }
    assert row(0) == ("b", 2, 4)
    # The old owner's fence fails: it can commit nothing more.
    with pytest.raises(LeaseLost), transaction.atomic():
        leases.fence("default", 0, 1)
    # Taken by the lease rules (expired): the term resets, so any Raft leader may take it.
    assert leases.acquire("default", 1, "c", START_MS + 20_000, 10) == 2
    assert row(1) == ("c", 2, 0)
    assert leases.acquire_as_leader("default", {1: 1}, "b", START_MS + 20_001, 10) == {1: 3}


class StandIn:
    """What the engine asks of :class:`durable.raft.groups.GroupSet`, with a fixed answer."""

    def __init__(self, me: str, leaders: dict[int, str]) -> None:
        self.me = me
        self.leaders = leaders
        self.sent: list[tuple[int, dict]] = []
        self.leadership_changes = 0

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def is_leader(self, shard):
        return self.leaders.get(shard) == self.me

    def led_by_other(self, shard):
        return self.leaders.get(shard) not in (None, self.me)

    def has_quorum(self, shard):
        return shard in self.leaders

    def term(self, shard):
        return 7

    def standby_due(self, shard, ahead_ms=0):
        return []

    def hand_away(self, shards):
        self.handed_away = list(shards)

    def leads_any(self, shards):
        return False

    def state_of(self, shard):
        from durable.raft.state import ShardState

        return ShardState()

    def replicate(self, shard, batch):
        self.sent.append((shard, batch))

    def hand_over(self, shard, handed):
        from durable.raft.state import shape

        self.sent.extend((shard, batch) for batch in shape(handed, self.term(shard)))

    def status(self):
        return {
            s: {
                "role": "leader" if leader == self.me else "follower",
                "term": 7,
                "leader": leader,
                "lag_ms": 0,
                "standby": 0,
            }
            for s, leader in self.leaders.items()
        }


def raft_engine(settings, clock, node: str, stand_in: StandIn) -> Engine:
    settings.DURABLE = {"SHARDS": 4, "LEASE_TTL_S": 10.0, "RESCAN_INTERVAL_S": 1.0}
    engine = Engine(node=node, clock=clock, threads=1)
    engine.raft = stand_in
    engine.keeper.raft = stand_in
    engine.start()
    return engine


def test_engine_takes_what_it_leads_gives_up_the_rest_and_replicates(settings, clock):
    stand_in = StandIn("n1", {0: "n1", 1: "n1", 2: "n2", 3: "n2"})
    engine = raft_engine(settings, clock, "n1", stand_in)
    try:
        timer = durable.schedule(probes.record, args=["r0"], delay=timedelta(seconds=5))
        engine.tick()
        assert sorted(engine.runners) == [0, 1]
        assert {s: row(s)[2] for s in (0, 1)} == {0: 7, 1: 7}
        # Shards 2 and 3 are led by n2: this node does not take them by the lease rules.
        assert row(2)[0] == row(3)[0] == ""
        # What entered the wheels is replicated after the turn.
        added = [entry for _, batch in stand_in.sent for entry in batch["add"]]
        if Timer.objects.get(pk=timer.pk).shard in (0, 1):
            assert [timer.pk, timer.fire_at_ms] in added
        # n2 now leads shard 1: given up at once, without waiting for any expiry.
        stand_in.leaders[1] = "n2"
        clock.advance(10)
        engine.tick()
        assert sorted(engine.runners) == [0]
        assert row(1)[0] == ""
        # No quorum for shard 3 (no leader known): the lease rules apply again.
        del stand_in.leaders[3]
        clock.advance(10)
        engine._next_rebalance_ms = 0
        engine.tick()
        assert 3 in engine.runners and row(3)[2] == 0
    finally:
        engine.shutdown(wait_s=0)


def test_heartbeat_publishes_the_view_and_status_shows_leaders(settings, clock):
    stand_in = StandIn("n1", {0: "n1", 1: "n2"})
    engine = raft_engine(settings, clock, "n1", stand_in)
    try:
        engine.tick()
        view = status_store.raft_view("default", clock.now_ms(), 10)
        assert view[0]["leader"] == "n1" and view[0]["term"] == 7
        assert view[1]["leader"] is None and view[1]["followers"] == ["n1"]
        assert raftlink.view(stand_in)[0] == {"role": "leader", "term": 7, "leader": "n1"}
        out = io.StringIO()
        call_command("durable_status", "--json", stdout=out)
        shards = {s["shard"]: s for s in json.loads(out.getvalue())["shards"]}
        assert shards[0]["raft"]["leader"] == "n1"
        text = io.StringIO()
        call_command("durable_status", stdout=text)
        assert "raft leader (term) / followers" in text.getvalue()
    finally:
        engine.shutdown(wait_s=0)
