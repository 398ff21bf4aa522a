"""Benchmark: what concurrency-key decisions add to fire lateness (issue 19's target: <= 1 ms p99).

    python bench/concurrency.py                  # 3 rounds of each, 6,000 timers at 600/s
    python bench/concurrency.py --rounds 1 --rate 300 --seconds 5
    python bench/concurrency.py --keys 1000      # keys spread over every shard

Both paths fire atomic no-op handlers from ``Engine.run()`` in a thread of this process
(``bench.peers.durable_side.EngineThread``), on the same database, alternating, same load:

* plain: ``@durable.handler``, no key;
* keyed: ``@durable.handler(concurrency_key=<one of --keys keys, 16>, rate_limit="200/s")``. The
  rate never binds at this load (at most ~40 starts a second per key), so every timer is
  admitted: what differs is the decision itself (lock each key's row, read its running
  timers and line, append to its window log) in every batch transaction.

A keyed timer lives on its key's shard: 16 keys put the keyed path's timers on at most 16
of the 64 shards, where the plain path's spread over all of them. ``--keys 1000`` spreads
them as the plain path's are (and makes each batch decide for more keys at once).

Lateness is the wall clock when the handler starts minus the due time, in ms. The database
is ``DURABLE_BENCH_URL`` (default ``durable_concurrency_bench`` on the local server; it
must exist, e.g. ``createdb -O durable durable_concurrency_bench``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import Lateness, quiet_gc, setup_django, wait_until, wall_ms

URL = os.environ.get(
    "DURABLE_BENCH_URL", "postgres://durable:durable@127.0.0.1:5432/durable_concurrency_bench"
)
KEYS = 16


def key_of(key: str) -> str:
    """The concurrency key of a :func:`keyed` call."""
    return key


def keyed(key: str) -> None:
    """The keyed no-op: records its lateness as ``durable_side.noop`` does."""
    import durable
    from bench.peers import durable_side as d

    fire = durable.current_fire()
    assert fire is not None
    d.RECORDER.events.append((fire.scheduled_ms, wall_ms()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=600, help="timers due per second")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--keys", type=int, default=KEYS, help="concurrency keys used")
    options = parser.parse_args()
    setup_django(URL)
    from django.core.management import call_command
    from django.db import transaction

    import durable
    from bench.peers import durable_side as d

    call_command("migrate", verbosity=0)

    # Registered here, after Django is set up (as "__main__.keyed"): the engine runs in
    # this process, so the registry it reads is this one.
    durable.handler(concurrency_key=key_of, rate_limit="200/s")(keyed)
    n = options.rate * options.seconds
    results: dict[str, list[Lateness]] = {"plain": [], "keyed": []}
    for _ in range(options.rounds):
        for mode in ("plain", "keyed"):
            d.reset_tables()
            t0 = int(wall_ms()) + 5_000
            with transaction.atomic():
                durable.schedule_many(
                    {
                        "fn": d.noop if mode == "plain" else keyed,
                        "args": [] if mode == "plain" else [f"k{i % options.keys}"],
                        "at": d.to_dt(t0 + i * 1000 // options.rate),
                    }
                    for i in range(n)
                )
            worker = d.EngineThread()
            d.RECORDER.reset()
            worker.start()
            wait_until(lambda: len(d.RECORDER) >= n, options.seconds + 60, 0.05)
            worker.stop()
            results[mode].append(Lateness.of(d.RECORDER.samples))
            quiet_gc()
    for mode, runs in results.items():
        for lat in runs:
            print(f"{mode:6} {lat}")
    plain = sorted(lat.p99 for lat in results["plain"])
    keyed_p99 = sorted(lat.p99 for lat in results["keyed"])
    median = len(plain) // 2
    added = keyed_p99[median] - plain[median]
    print(
        f"median p99: plain {plain[median]:.1f} ms, keyed {keyed_p99[median]:.1f} ms, "
        f"added {added:+.1f} ms (target <= 1 ms; {options.keys} keys)"
    )


if __name__ == "__main__":
    main()
