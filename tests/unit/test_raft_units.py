"""The Raft layer's pure parts: settings parsing and checks, the replicated shard state,
the standby wheel (durable.raft.config, state, standby; no network)."""

from __future__ import annotations

import pytest
from django.test import override_settings

from durable.checks import check_raft
from durable.raft.config import RaftConfigError, parse, problems
from durable.raft.standby import overdue
from durable.raft.state import BadBatch, ShardState, make_batch

RAW = {
    "SELF": "127.0.0.1:7100",
    "PEERS": ["127.0.0.1:7200", "127.0.0.1:7300"],
    "PASSWORD": "s3cret",
}


def ids(found: list[tuple[str, str]]) -> list[str]:
    return [check_id for check_id, _ in found]


def test_off_when_absent_or_none():
    assert parse(None, 64) is None
    assert problems(None, 64) == []


def test_parse_defaults_and_group_addresses():
    config = parse(RAW, 64)
    assert config is not None
    assert config.self_addr == config.bind == "127.0.0.1:7100"
    assert config.peers == ("127.0.0.1:7200", "127.0.0.1:7300")
    assert config.group_address("127.0.0.1:7200", 5) == "127.0.0.1:7205"
    assert config.bind_host == "127.0.0.1"
    assert config.election_min_s > 3 * config.heartbeat_s


def test_self_override_shares_one_peer_list():
    # Three processes, one settings module: each names itself; the rest are its peers.
    config = parse(RAW, 64, self_override="127.0.0.1:7200", bind_override="127.0.0.12:7200")
    assert config is not None
    assert config.self_addr == "127.0.0.1:7200"
    assert config.bind == "127.0.0.12:7200" and config.bind_host == "127.0.0.12"
    assert config.peers == ("127.0.0.1:7100", "127.0.0.1:7300")


@pytest.mark.parametrize(
    ("change", "check_id", "words"),
    [
        ({"PASSWORD": ""}, "durable.E022", "PASSWORD"),
        ({"PASSWORD": None}, "durable.E022", "PASSWORD"),
        ({"SELF": "localhost"}, "durable.E023", "host:port"),
        ({"PEERS": ["127.0.0.1:0"]}, "durable.E023", "port"),
        ({"PEERS": "127.0.0.1:7200"}, "durable.E023", "list"),
        ({"SELF": "127.0.0.1:65500"}, "durable.E024", "65535"),
        ({"PEERS": ["127.0.0.1:7100"]}, "durable.E025", "PEERS"),
        ({"TICK_S": 0}, "durable.E021", "TICK_S"),
        ({"ELECTION_TIMEOUT_S": [0.9, 0.4]}, "durable.E021", "ELECTION_TIMEOUT_S"),
        ({"HEARTBEAT_S": 0.2}, "durable.E021", "3 x HEARTBEAT_S"),
        ({"BALANCE_S": -1}, "durable.E021", "BALANCE_S"),
        ({"PORT": 1}, "durable.E020", "PORT"),
    ],
)
def test_every_problem_is_named(change, check_id, words):
    found = problems({**RAW, **change}, 64)
    assert check_id in ids(found), found
    assert any(words in message for _, message in found), found
    with pytest.raises(RaftConfigError, match="DURABLE\\['RAFT'\\] is invalid"):
        parse({**RAW, **change}, 64)


def test_not_a_dict():
    assert ids(problems("on", 64)) == ["durable.E020"]


@override_settings(DURABLE={"RAFT": RAW})
def test_check_refuses_sqlite_and_accepts_postgres(settings):
    engine = settings.DATABASES["default"]["ENGINE"]
    found = {m.id for m in check_raft()}
    if engine.endswith("sqlite3"):
        assert found == {"durable.E026"}
    else:
        assert found == set()


@override_settings(DURABLE={"RAFT": {**RAW, "PASSWORD": ""}})
def test_check_reports_missing_password():
    assert "durable.E022" in {m.id for m in check_raft()}


@override_settings(DURABLE={"RAFT": None})
def test_check_silent_when_off():
    assert check_raft() == []


# --- the replicated state ---------------------------------------------------------------


def batch(**kw):
    base = {"owner": "n1", "token": 3, "term": 2, "cursor_ms": 1000}
    return make_batch(**{**base, **kw})


def test_apply_adds_removes_and_moves_the_cursor():
    state = ShardState()
    state.apply(batch(added=[(1, 500), (2, 900)], at_ms=7))
    assert state.pending == {1: 500, 2: 900}
    assert (state.owner, state.token, state.term, state.cursor_ms) == ("n1", 3, 2, 1000)
    assert (state.batches, state.last_at_ms) == (1, 7)
    state.apply(batch(cursor_ms=2000, removed=[1, 99], added=[(2, 1500)]))
    assert state.pending == {2: 1500} and state.cursor_ms == 2000
    assert (state.owner, state.token, state.batches) == ("n1", 3, 2)


def test_a_late_batch_of_an_older_owner_changes_nothing():
    state = ShardState()
    state.apply(batch(token=5, added=[(1, 500)], cursor_ms=3000))
    state.apply(batch(token=4, removed=[1], cursor_ms=100, owner="old"))
    assert state.pending == {1: 500} and state.cursor_ms == 3000 and state.owner == "n1"
    assert (state.token, state.batches) == (5, 1)


def test_replicas_applying_one_log_agree():
    log = [batch(added=[(i, i * 10)]) for i in range(50)] + [batch(removed=list(range(0, 50, 2)))]
    a, b = ShardState(), ShardState()
    for entry in log:
        a.apply(entry)
        b.apply(entry)
    assert a == b and len(a.pending) == 25


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {**make_batch(owner="n", token=1, term=1, cursor_ms=0), "token": "1"},
        {**make_batch(owner="n", token=1, term=1, cursor_ms=0), "add": [[1]]},
        {**make_batch(owner="n", token=1, term=1, cursor_ms=0), "add": [[1, "x"]]},
        {**make_batch(owner="n", token=1, term=1, cursor_ms=0), "remove": ["1"]},
        {**make_batch(owner="n", token=1, term=1, cursor_ms=0), "owner": 1},
        {**make_batch(owner="n", token=1, term=1, cursor_ms=0), "at_ms": True},
    ],
)
def test_a_malformed_batch_is_refused_whole(bad):
    state = ShardState()
    state.apply(batch(added=[(1, 5)]))
    before = (dict(state.pending), state.token, state.cursor_ms, state.batches)
    with pytest.raises(BadBatch):
        state.apply(bad)
    assert (dict(state.pending), state.token, state.cursor_ms, state.batches) == before


# --- the standby wheel -----------------------------------------------------------------


def test_standby_gives_what_is_due_oldest_first_until_the_log_removes_it():
    state = ShardState()
    state.apply(batch(added=[(1, 1500), (2, 2500), (3, 900), (4, 1500)]))
    assert overdue(state.pending, 1000) == [(3, 900)]
    assert overdue(state.pending, 1600) == [(3, 900), (1, 1500), (4, 1500)]
    assert overdue(state.pending, 1700) == [(3, 900), (1, 1500), (4, 1500)]  # kept
    state.apply(batch(added=[(2, 5000)], removed=[1, 4]))  # fired; rescheduled later
    assert overdue(state.pending, 3000) == [(3, 900)]


def test_standby_never_gives_out_a_timer_early():
    pending = {i: i * 7 for i in range(1, 200)}
    for now in range(0, 1500, 13):
        due = overdue(pending, now)
        assert all(fire_at <= now and pending[i] == fire_at for i, fire_at in due)
        assert len(due) == sum(1 for t in pending.values() if t <= now)
