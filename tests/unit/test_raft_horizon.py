"""Raft on, the owner replicates a timer only once it is within REPLICATE_AHEAD_MS of its
fire time (durable.worker.runner), so the replicated state, and pysyncobj's full-state
transfer of it, stay a minute of timers however many the wheel holds; and a turn's journal
is handed over as it is, shaped into batches by the sidecar (durable.raft.state.shape)."""

from __future__ import annotations

from durable.conf import DurableSettings
from durable.raft.state import MAX_COMMAND_ENTRIES, Handed, ShardState, shape
from durable.worker.runner import LATER_SHIFT, REPLICATE_AHEAD_MS, ShardRunner

NOW = 1_800_000_000_000
SLOT = 1 << LATER_SHIFT


def runner_with(rows: list[tuple[int, int]]) -> ShardRunner:
    runner = ShardRunner(shard=0, token=3, db="default", conf=DurableSettings(), now_ms=NOW)
    runner.loaded_upto_bucket = 10**9  # everything is in the horizon
    runner.start_journal(NOW)
    runner.add_many(rows)
    return runner


def test_only_the_next_minute_is_replicated_of_an_hour_in_the_wheel():
    # 36,000 timers over the next hour, one every 100 ms.
    rows = [(i, NOW + 100 * i) for i in range(1, 36_001)]
    runner = runner_with(rows)
    assert len(runner.wheel) == 36_000
    sent = runner.take_journal(NOW)
    # What is within a minute (and the rest of the last 8.2 s slot), not the hour.
    assert all(fire_at < NOW + REPLICATE_AHEAD_MS + 2 * SLOT for fire_at in sent.values())
    assert {i for i, _ in rows if _ < NOW + REPLICATE_AHEAD_MS} <= set(sent)
    assert len(sent) < 800
    # Ten minutes later: what came within the minute since, except what left the wheel.
    later = NOW + 600_000
    runner.wheel.cancel(6_000)  # due at NOW + 600 s; gone before it was ever sent
    runner.add(99_999, NOW + 20_000)  # a NOTIFY'd timer due soon: sent at once
    sent_later = runner.take_journal(later)
    assert 99_999 in sent_later and 6_000 not in sent_later
    assert not set(sent) & set(sent_later)
    due_next_minute = {i for i, t in rows if t < later + REPLICATE_AHEAD_MS and i != 6_000}
    assert due_next_minute <= set(sent) | set(sent_later)
    assert max(sent_later.values()) < later + REPLICATE_AHEAD_MS + 2 * SLOT
    # A jump of a year (time travel) walks only the slots there are.
    rest = runner.take_journal(NOW + 365 * 86_400_000)
    assert len(sent) + len(sent_later) + len(rest) == 36_000  # 6,000 out, 99,999 in
    assert runner.later == {}


def test_a_handed_journal_is_shaped_into_bounded_batches_that_apply():
    journal: dict[int, int | None] = {i: NOW + i for i in range(2_500)}
    journal.update(dict.fromkeys(range(10_000, 10_010)))
    batches = shape(Handed("n1", 3, NOW, journal, NOW), term=5)
    assert len(batches) == 3
    assert all(len(b["add"]) + len(b["remove"]) <= MAX_COMMAND_ENTRIES + 10 for b in batches)
    state = ShardState()
    for batch in batches:
        state.apply(batch)
    assert len(state.pending) == 2_500 and state.term == 5 and state.token == 3
    # An empty journal (the cursor alone moved) is still one batch.
    assert len(shape(Handed("n1", 3, NOW, {}, NOW), term=5)) == 1
