"""Cost of one retention batch of fired timers, by batch size, or against ``QuerySet.delete()``.

    python bench/soak.py --quick          # leaves fired rows in durable_soak
    python bench/prune_batch.py           # then: alternating batches of 1,000, each timed
    python bench/prune_batch.py --cluster --sizes 50,100,200,500,1000   # sizes, own server

Without ``--cluster`` the rows must be fired ones already in the soak's database
(``SOAK_DB``); each round deletes one batch with the previous way (ids, then
``QuerySet.delete()``: Django loads every row for the ``SET_NULL`` of ``parent`` and
deletes in chunks of 100) and one with the current one (ids locked, children unlinked,
one ``DELETE``). With ``--sizes`` each round deletes one batch of every size both
current ways, alternating: one statement (PostgreSQL's) and the three statements in a
transaction (other databases', and PostgreSQL's before the soak on a production-like
server).

``--cluster``: a throwaway cluster (``durable.testing.cluster``, as root; ``fsync``,
``synchronous_commit`` and ``autovacuum`` on, as ``bench/soak.py --cluster``) on a port
from ``SOAK_CLUSTER_PORT`` (26000) up, holding ``--pending`` pending timers 30 days out
and ``--fired`` fired ones past their retention, ``VACUUM ANALYZE``d; destroyed at the
end. Prints the milliseconds of each batch, the median per size, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import REPO, setup_django

URL = "postgres://durable:durable@127.0.0.1:5432/" + os.environ.get("SOAK_DB", "durable_soak")


def load() -> str:
    """The 1-minute load average."""
    return Path("/proc/loadavg").read_text().split()[0]


def previous(db: str, older_than_ms: int, batch: int = 1000) -> int:
    """``prune_finished`` before the soak (main at 464629a)."""
    from durable.models import Timer, TimerState
    from durable.storage.leases import ms_to_dt

    cutoff = ms_to_dt(older_than_ms)
    ids = list(
        Timer.objects.using(db)
        .filter(state__in=[TimerState.FIRED, TimerState.CANCELED], updated_at__lt=cutoff)
        .order_by("updated_at")
        .values_list("id", flat=True)[:batch]
    )
    deleted, _ = Timer.objects.using(db).filter(id__in=ids).delete()
    return deleted


def compare(rounds: int) -> None:
    """Alternate a batch of 1,000 the previous way and the current way."""
    from durable.storage import retention

    cutoff = int(time.time() * 1000)
    for round_ in range(rounds):
        for name in ("QuerySet.delete()", "prune_finished"):
            started = time.perf_counter()
            if name == "prune_finished":
                n = retention.prune_finished("default", cutoff, 1000)
            else:
                n = previous("default", cutoff, 1000)
            ms = (time.perf_counter() - started) * 1000
            print(f"round {round_}: {name}: {n} rows in {ms:.0f} ms (load {load()})")


def by_size(sizes: list[int], rounds: int) -> None:
    """Each round one batch of every size each way, alternating; the milliseconds."""
    from durable.storage import retention
    from durable.storage.leases import ms_to_dt

    cutoff = int(time.time() * 1000)
    ways = {
        "one statement": lambda size: retention.prune_finished("default", cutoff, size),
        "three in a transaction": lambda size: retention._prune_finished_in_transaction(
            "default", ms_to_dt(cutoff), size
        ),
    }
    took: dict[tuple[str, int], list[float]] = {}
    for round_ in range(rounds):
        for size in sizes:
            for way, prune in ways.items():
                started = time.perf_counter()
                n = prune(size)
                ms = (time.perf_counter() - started) * 1000
                took.setdefault((way, size), []).append(ms)
                print(f"round {round_}: {way}, batch {size}: {n} rows in {ms:.1f} ms", end="")
                print(f" (load {load()})")
    for (way, size), values in sorted(took.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        median = statistics.median(values)
        print(
            f"batch {size:>5}, {way:<22}: median {median:5.1f} ms, max {max(values):5.1f} ms"
            f" over {len(values)} ({1000 * median / size:.0f} us/row)"
        )


def fill(pending: int, fired: int) -> None:
    """Pending timers 30 days out and fired ones a day old, then ``VACUUM ANALYZE``."""
    from bench.peers.durable_side import raw, sql_insert

    now = int(time.time() * 1000)
    sql_insert(pending, now + 30 * 86_400_000, 86_400_000 / max(pending, 1))
    sql_insert(fired, now - 86_400_000, 1.0)
    raw(
        "UPDATE durable_timer SET state = 'fired', fired_at = now() - interval '1 day',"
        " updated_at = now() - interval '1 day' + (id || ' ms')::interval"
        " WHERE fire_at_ms < %s",
        [now],
    )
    raw("VACUUM ANALYZE durable_timer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--sizes", help="comma-separated batch sizes (default: the comparison)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cluster", action="store_true", help="on a throwaway cluster")
    parser.add_argument("--pending", type=int, default=200_000)
    parser.add_argument("--fired", type=int, default=60_000)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
    if not args.cluster:
        setup_django(URL, DJANGO_DEBUG="false")
        by_size(sizes, args.rounds) if sizes else compare(args.rounds)
        return
    from bench.soak import CLUSTER_OPTIONS, CLUSTER_PORT
    from durable.testing.cluster import TemporaryCluster, free_port

    with TemporaryCluster(port=free_port(CLUSTER_PORT), options=CLUSTER_OPTIONS) as cluster:
        url = cluster.create_database("durable_prune")
        env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "testproject.settings"}
        migrate = [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"]
        subprocess.run(migrate, cwd=REPO, env=env, check=True)
        setup_django(url, DJANGO_DEBUG="false")
        fill(args.pending, args.fired)
        print(f"cluster port {cluster.port}: {args.pending:,} pending, {args.fired:,} fired")
        by_size(sizes, args.rounds) if sizes else compare(args.rounds)


if __name__ == "__main__":
    main()
