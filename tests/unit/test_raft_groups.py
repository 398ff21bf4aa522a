"""Real pysyncobj groups in one process on loopback (a few shards, a few seconds each):
leaders elected and spread, a batch replicated to the followers' standby wheels, a node
with another password refused and logged, a port in use named in the error."""

from __future__ import annotations

import logging
import random
import socket
import time

import pytest

from durable.raft import transport
from durable.raft.config import parse
from durable.raft.groups import GroupSet, RaftBindError
from durable.raft.state import make_batch

pytest.importorskip("pysyncobj")

SHARDS = 3


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def addresses() -> list[str]:
    # Below Linux's ephemeral range (32768+), where outgoing connections take ports.
    base = random.randrange(20_000, 32_000, 100)
    return [f"127.0.0.1:{base + 10 * i}" for i in range(3)]


def start(addrs: list[str], passwords: list[str]) -> list[GroupSet]:
    raw = {"SELF": addrs[0], "PEERS": addrs[1:], "PASSWORD": "x"}
    sets = []
    for addr, password in zip(addrs, passwords, strict=True):
        config = parse({**raw, "PASSWORD": password}, SHARDS, self_override=addr)
        assert config is not None
        group_set = GroupSet(config, range(SHARDS), now_ms)
        group_set.start()
        sets.append(group_set)
    return sets


def wait(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_leaders_replication_and_standby():
    addrs = addresses()
    sets = start(addrs, ["pw"] * 3)
    try:
        wait(lambda: all(g.leader_of(s) for g in sets for s in range(SHARDS)))
        # Sliced election timeouts: shard s's first-ranked node wins at start.
        leaders = {sets[0].leader_of(s) for s in range(SHARDS)}
        assert len(leaders) >= 2, leaders
        leader = next(g for g in sets if g.is_leader(0))
        past = now_ms() - 1000
        leader.replicate(
            0,
            make_batch(
                owner="n",
                token=4,
                term=leader.term(0),
                cursor_ms=past,
                added=[(1, past), (2, now_ms() + 3_600_000)],
                at_ms=now_ms(),
            ),
        )
        wait(
            lambda: all(
                g.state_of(0).pending == {1: past, 2: g.state_of(0).pending.get(2)}
                and len(g.state_of(0).pending) == 2
                for g in sets
            )
        )
        for g in sets:
            assert [i for i, _ in g.standby_due(0)] == [1]
            row = g.status()[0]
            assert row["standby"] == 2 and row["lag_ms"] >= 0
            assert g.has_quorum(0)
        assert sum(g.led_by_other(0) for g in sets) == 2
    finally:
        for g in sets:
            g.stop()


def test_a_lone_survivor_has_no_quorum_and_so_falls_back_to_the_leases():
    addrs = addresses()
    sets = start(addrs, ["pw"] * 3)
    try:
        wait(lambda: all(g.leader_of(s) for g in sets for s in range(SHARDS)))
        assert all(sets[0].has_quorum(s) for s in range(SHARDS))
        for g in sets[1:]:
            g.stop()
        # pysyncobj alone keeps naming the dead leader (it stands for election only when
        # connected to someone): the group set must not.
        wait(lambda: not any(sets[0].has_quorum(s) for s in range(SHARDS)), timeout_s=10)
        assert not any(sets[0].led_by_other(s) for s in range(SHARDS))
    finally:
        sets[0].stop()


def test_wrong_password_is_refused_and_logged(caplog):
    addrs = addresses()
    before = transport.refused_total
    transport._last_refusal.clear()
    caplog.set_level(logging.WARNING, logger="durable.raft")
    sets = start(addrs, ["pw", "pw", "wrong"])
    try:
        wait(lambda: all(sets[0].leader_of(s) for s in range(SHARDS)))
        wait(lambda: transport.refused_total > before)
        assert any("raft.peer_refused" in r.getMessage() for r in caplog.records)
        # The outsider never learns a leader, and is never one for the others.
        time.sleep(1.0)
        assert all(sets[2].leader_of(s) in (None, addrs[2]) for s in range(SHARDS))
        assert all(not sets[2].is_leader(s) for s in range(SHARDS))
        assert all(g.leader_of(s) != addrs[2] for g in sets[:2] for s in range(SHARDS))
    finally:
        for g in sets:
            g.stop()


def test_a_port_in_use_is_named():
    for _ in range(20):  # a port another process took meanwhile: try other ports
        addrs = addresses()
        host, port = addrs[0].rsplit(":", 1)
        blocker = socket.socket()
        try:
            blocker.bind((host, int(port) + 1))  # shard 1's port
            break
        except OSError:
            blocker.close()
    else:
        pytest.fail("no free port pair for the test")
    blocker.listen()
    try:
        config = parse({"SELF": addrs[0], "PEERS": addrs[1:], "PASSWORD": "pw"}, SHARDS)
        assert config is not None
        with pytest.raises(RaftBindError, match=f"cannot listen on {host}:{int(port) + 1}"):
            GroupSet(config, range(SHARDS), now_ms).start()
    finally:
        blocker.close()


def test_the_first_node_started_does_not_win_every_group():
    # Started alone, it waits past every election timeout; when the others come up, the
    # election timers count from the first connection and the node ranked first in each
    # group wins it (before: the first node stood at once in every group and won all).
    addrs = addresses()
    raw = {"SELF": addrs[0], "PEERS": addrs[1:], "PASSWORD": "pw"}
    configs = [parse(raw, SHARDS, self_override=a) for a in addrs]
    sets = [GroupSet(c, range(SHARDS), now_ms) for c in configs if c is not None]
    try:
        sets[0].start()
        time.sleep(1.5)  # past the longest election timeout (1.2 s)
        for g in sets[1:]:
            g.start()
        wait(lambda: all(g.leader_of(s) for g in sets for s in range(SHARDS)))
        leaders = [sets[0].leader_of(s) for s in range(SHARDS)]
        assert leaders.count(addrs[0]) < SHARDS, leaders
    finally:
        for g in sets:
            g.stop()


@pytest.mark.parametrize("size", [0, 1, 109, 65_535, 65_536, 200_001])
def test_frames_go_out_as_zlib_streams_pysyncobj_reads(size):
    import zlib

    data = random.Random(size).randbytes(size)
    framed = transport._zlib_stored(data)
    assert zlib.decompress(framed) == data  # what pysyncobj's receiver runs on every frame
    assert len(framed) <= size + 11 + 5 * (size // transport.STORED_BLOCK)  # stored, no more


def test_a_stopping_node_hands_its_leaderships_to_its_peers_with_no_election_wait():
    addrs = addresses()
    sets = start(addrs, ["pw"] * 3)
    try:
        wait(lambda: all(g.leader_of(s) for g in sets for s in range(SHARDS)))
        leader = next(g for g in sets if any(g.is_leader(s) for s in range(SHARDS)))
        led = [s for s in range(SHARDS) if leader.is_leader(s)]
        terms = {s: leader.term(s) for s in led}
        leader.hand_away(list(range(SHARDS)))
        # While it still runs: nothing else would move a live leader's groups (no
        # election timeout passes while it sends heartbeats).
        wait(lambda: not leader.leads_any(list(range(SHARDS))), timeout_s=5)
        others = [g for g in sets if g is not leader]
        wait(lambda: all(any(g.is_leader(s) for g in others) for s in led), timeout_s=5)
        assert all(leader.term(s) == terms[s] + 1 for s in led)  # one round, no split vote
    finally:
        for g in sets:
            g.stop()
