"""Issue 17, scenario 3: an owner cut off from its Raft peers, not from PostgreSQL.

Three nodes, Raft on, default settings otherwise, Raft traffic through the test's proxy.
The node holding the most shards is cut off (every Raft link of it closed, new ones
refused) while timers fire. Asserted: the majority takes every one of its shards within
2 s of the cut; after the takeover of a shard the isolated node commits nothing there
(no timer fired under its old token after the new owner's ``lease.takeover``); when the
link comes back it rejoins (alive, the cluster keeps every shard owned, it fires again
under new tokens only); every timer fires exactly once, none early.
"""

from __future__ import annotations

import time

import pytest

import durable
from durable.models import Timer
from testproject.demo import probes
from tests.acceptance.helpers import (
    SHARDS,
    assert_exactly_once,
    fired_count,
    metric,
    now_ms,
)
from tests.acceptance.raft_cluster import (
    acquired_at_ms,
    at,
    check_timing,
    held,
    led_by_owners,
    raft_cluster,
    raft_views,
    skip_without_raft,
    spread_over,
    wait_all_fired,
)

pytestmark = [
    pytest.mark.acceptance,
    pytest.mark.postgres,
    pytest.mark.long,
    pytest.mark.django_db(transaction=True),
]

COUNT, LEAD_MS, SPREAD_MS = 6_000, 3_000, 20_000
TAKEOVER_MS = 2_000


def test_partitioned_owner_loses_its_shards_fast_and_commits_nothing_after(
    tmp_path, record_property
):
    skip_without_raft()
    names = ["n1", "n2", "n3"]
    with raft_cluster(tmp_path / "logs", SHARDS, proxied=True) as (pool, _, proxy):
        assert proxy is not None
        pool.wait_until(
            lambda: spread_over(names, SHARDS) and led_by_owners(pool, SHARDS),
            timeout_s=90,
            what="three Raft nodes holding every shard between them, each as its leader",
            require_alive=names,
        )
        first_due = now_ms() + LEAD_MS
        durable.schedule_many(
            {"fn": probes.record, "args": [f"p{i}"], "at": at(first_due + i * SPREAD_MS // COUNT)}
            for i in range(COUNT)
        )
        pool.wait_until(
            lambda: fired_count("p") >= COUNT // 5,
            timeout_s=60,
            what="a fifth of the timers fired before the cut",
            require_alive=names,
        )
        owners = held()
        victim = max(names, key=lambda n: len(owners.get(n, {})))
        old = owners[victim]
        assert old, f"{victim} holds nothing\n{pool.logs()}"
        terms_at_cut = {s: v["term"] for s, v in raft_views([victim])[victim].items()}
        cut_ms = now_ms()
        links = proxy.cut(victim)
        others = [n for n in names if n != victim]

        def moved() -> bool:
            now = held()
            return all(any(s in now.get(n, {}) for n in others) for s in old)

        took = pool.wait_until(
            moved,
            timeout_s=30,
            what=f"the majority taking {victim}'s {len(old)} shards",
            require_alive=names,
        )
        metric(record_property, "partition_links_cut", links)
        metric(record_property, "partition_victim_shards", len(old))
        metric(record_property, "partition_takeover_s", round(took, 2))
        # Isolated for a while longer: it must not win anything back over PostgreSQL.
        time.sleep(3)
        assert not set(held().get(victim, {})) & set(old), pool.logs()
        proxy.restore(victim)

        def not_following() -> dict[int, object]:
            # Its heartbeat's view of every shard it lost, where it does not yet follow a
            # leader in a newer term than at the cut (the balancer waits longer than a
            # heartbeat before it moves any leadership back).
            view = raft_views([victim]).get(victim, {})
            return {
                s: view.get(s)
                for s in old
                if s not in view
                or view[s]["role"] != "follower"
                or int(view[s]["term"]) <= int(terms_at_cut.get(s, 0))
            }

        rejoin_s = pool.wait_until(
            lambda: not not_following(),
            timeout_s=30,
            what=f"{victim} following the new leaders after the link came back",
            require_alive=names,
            explain=lambda: (
                f"not following yet: {not_following()}; terms at the cut: "
                f"{ {s: terms_at_cut.get(s) for s in old} }"
            ),
        )
        metric(record_property, "partition_rejoined_as_follower_s", round(rejoin_s, 2))
        wait_all_fired(pool, "p", COUNT, names)
        pool.wait_until(
            lambda: spread_over(names, SHARDS),
            timeout_s=60,
            what=f"{victim} back among the owners after the link came back",
            require_alive=names,
        )
        acquired: dict[tuple[int, int], int] = {}
        for name in others:
            acquired |= acquired_at_ms(pool.workers[name])

    assert_exactly_once((f"p{i}" for i in range(COUNT)), "p", pool)
    # The fence, from the rows: in each of the victim's shards, nothing fired under its
    # old token after another node first took that shard under a newer token.
    taken_at: dict[int, int] = {}
    for (shard, token), ms in acquired.items():
        if shard in old and token > old[shard]:
            taken_at[shard] = min(ms, taken_at.get(shard, ms))
    assert set(taken_at) == set(old), (sorted(old), sorted(taken_at))
    late = []
    for shard, token in old.items():
        rows = Timer.objects.filter(shard=shard, fired_token=token).values_list("id", "fired_at")
        late += [(shard, tid) for tid, f in rows if f and f.timestamp() * 1000 > taken_at[shard]]
    assert not late, f"{victim} committed under its old token after the takeover: {late[:10]}"
    worst = max(taken_at.values()) - cut_ms
    metric(record_property, "partition_last_takeover_logged_ms", worst)
    check_timing("the majority taking the partitioned node's shards", took * 1000, TAKEOVER_MS)
