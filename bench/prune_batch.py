"""Cost of one retention batch: ``retention.prune_finished`` against ``QuerySet.delete()``.

    python bench/soak.py --quick          # leaves fired rows in durable_soak
    python bench/prune_batch.py           # then: alternating batches of 1,000, each timed

The rows must be fired ones already in the soak's database (``SOAK_DB``); each round
deletes one batch with the previous way (ids, then ``QuerySet.delete()``: Django loads
every row for the ``SET_NULL`` of ``parent`` and deletes in chunks of 100) and one with
the current one (ids locked, children unlinked, one ``DELETE``). Prints the
milliseconds of each and the load average.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import setup_django

URL = "postgres://durable:durable@127.0.0.1:5432/" + os.environ.get("SOAK_DB", "durable_soak")


def main() -> None:
    setup_django(URL, DJANGO_DEBUG="false")
    from durable.models import Timer, TimerState
    from durable.storage import retention
    from durable.storage.leases import ms_to_dt

    def previous(db: str, older_than_ms: int, batch: int = 1000) -> int:
        """``prune_finished`` before the soak (main at 464629a)."""
        cutoff = ms_to_dt(older_than_ms)
        ids = list(
            Timer.objects.using(db)
            .filter(state__in=[TimerState.FIRED, TimerState.CANCELED], updated_at__lt=cutoff)
            .order_by("updated_at")
            .values_list("id", flat=True)[:batch]
        )
        deleted, _ = Timer.objects.using(db).filter(id__in=ids).delete()
        return deleted

    cutoff = int(time.time() * 1000)
    print("fired rows:", Timer.objects.filter(state="fired").count())
    for round_ in range(3):
        for name, prune in (("QuerySet.delete()", previous), ("prune_finished", None)):
            started = time.perf_counter()
            if prune is None:
                n = retention.prune_finished("default", cutoff, 1000)
            else:
                n = prune("default", cutoff, 1000)
            ms = (time.perf_counter() - started) * 1000
            load = Path("/proc/loadavg").read_text().split()[0]
            print(f"round {round_}: {name}: {n} rows in {ms:.0f} ms (load {load})")


if __name__ == "__main__":
    main()
