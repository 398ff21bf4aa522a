"""Real ``run_timer_shards`` processes for acceptance tests, and what the database says.

:class:`WorkerPool` is :class:`durable.testing.nodes.WorkerPool` (start, kill, freeze,
restart, stop them all at the end; ``wait_until`` with deadlines and every worker's log)
set up for this repository's test project and the handlers under ``tests/acceptance``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from django.db import connections, transaction
from django.db.models import Count, F

from durable.conf import DurableSettings
from durable.models import ShardLease, Timer
from durable.testing import nodes

# Re-exported: the acceptance tests import these from here.
from durable.testing.nodes import app_name as app_name
from durable.testing.nodes import database_url as database_url
from testproject.demo.models import FireRecord

REPO_ROOT = Path(__file__).resolve().parents[2]
# The workers run durable's default settings (acceptance tests use defaults unless a
# test is about a setting); these name them for the tests' deadlines.
_DEFAULTS = DurableSettings()
SHARDS = _DEFAULTS.SHARDS
LEASE_TTL_S = _DEFAULTS.LEASE_TTL_S
RESCAN_INTERVAL_S = _DEFAULTS.RESCAN_INTERVAL_S
BATCH_TIME_BUDGET_S = _DEFAULTS.BATCH_TIME_BUDGET_S


def now_ms() -> int:
    """Wall-clock epoch milliseconds (what the workers' clocks read on this machine)."""
    return time.time_ns() // 1_000_000


class WorkerPool(nodes.WorkerPool):
    """:class:`durable.testing.nodes.WorkerPool` on this repository's test project, with
    the acceptance tests' handlers and (unless ``defaults``) their timings."""

    def __init__(
        self,
        *,
        database_url: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        defaults: bool = False,
        settings_module: str = "testproject.settings",
    ):
        """``defaults``: the workers run durable's default settings (no tuning for tests)."""
        tuning = {
            "DURABLE_SHARDS": str(SHARDS),
            "DURABLE_LEASE_TTL_S": str(LEASE_TTL_S),
            "DURABLE_RESCAN_INTERVAL_S": str(RESCAN_INTERVAL_S),
            "DURABLE_BATCH_TIME_BUDGET_S": str(BATCH_TIME_BUDGET_S),
        }
        super().__init__(
            database_url=database_url,
            log_dir=log_dir,
            cwd=REPO_ROOT,
            settings_module=settings_module,
            env={
                **({} if defaults else tuning),
                # The handlers and workflows these tests fire live under tests/, not in an app.
                "DURABLE_IMPORTS": "tests.acceptance.handlers,tests.acceptance.workflows",
                **(env or {}),
            },
        )


# --- what the database says ---------------------------------------------------------


def lease_owners() -> dict[str, list[int]]:
    """Owner name → shards it holds (``""`` for released ones)."""
    owners: dict[str, list[int]] = {}
    for shard, owner in ShardLease.objects.order_by("shard").values_list("shard", "owner"):
        owners.setdefault(owner, []).append(shard)
    return owners


def owned_by(name: str) -> list[int]:
    """Shards whose lease row names ``name`` as owner."""
    return lease_owners().get(name, [])


def fired_count(prefix: str = "") -> int:
    """FireRecord rows whose key starts with ``prefix``."""
    return FireRecord.objects.filter(key__startswith=prefix).count()


def pending_count() -> int:
    """Timers not finished yet (pending, or claimed by an external handler)."""
    return Timer.objects.filter(state__in=["pending", "firing"]).count()


def duplicated_keys(prefix: str = "") -> dict[str, int]:
    """Keys with more than one FireRecord (each one is an exactly-once violation)."""
    rows = (
        FireRecord.objects.filter(key__startswith=prefix)
        .values("key")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .values_list("key", "n")
    )
    return dict(rows[:20])


def early_fires(prefix: str = "") -> list[tuple[str, int, int]]:
    """``(key, fired_at_ms, due_at_ms)`` of records fired before they were due."""
    rows = FireRecord.objects.filter(key__startswith=prefix, fired_at_ms__lt=F("due_at_ms"))
    return list(rows.values_list("key", "fired_at_ms", "due_at_ms")[:20])


def progress(prefix: str) -> str:
    """Where a run stands, for assertion messages: fires, unfinished timers, duplicates."""
    return (
        f"{fired_count(prefix)} {prefix!r} FireRecord rows, {pending_count()} timers "
        f"unfinished, duplicated keys: {duplicated_keys(prefix) or 'none'}"
    )


def assert_exactly_once(keys: Iterable[str], prefix: str, pool: WorkerPool) -> None:
    """Every key in ``keys`` has exactly one FireRecord, none early, and no stray ones."""
    expected = set(keys)
    got = set(FireRecord.objects.filter(key__startswith=prefix).values_list("key", flat=True))
    missing = sorted(expected - got)
    stray = sorted(got - expected)
    dup = duplicated_keys(prefix)
    early = early_fires(prefix)
    total = fired_count(prefix)
    problems = []
    if missing:
        problems.append(f"{len(missing)} never fired, e.g. {missing[:10]}")
    if stray:
        problems.append(f"{len(stray)} unexpected keys fired, e.g. {stray[:10]}")
    if dup:
        problems.append(f"fired more than once: {dup}")
    if early:
        problems.append(f"fired early (key, fired_at_ms, due_at_ms): {early}")
    if total != len(expected):
        problems.append(f"{total} FireRecord rows for {len(expected)} timers")
    assert not problems, "; ".join(problems) + "\n" + pool.logs()


def metric(record_property: Callable[[str, object], None], name: str, value: object) -> None:
    """Keep a measured figure in the JUnit report and print it (``pytest -s`` shows it)."""
    record_property(name, value)
    print(f"METRIC {name}={value}")


def write_out_of_id_order(write: Callable[[int], None], parts: int = 4) -> None:
    """Run ``write(part)`` for each part in a transaction of its own, from ``parts``
    threads: the parts take their ids in order (0 first) and commit in reverse (the last
    part first, part 0 last and 1.5 s later), so rows with smaller ids appear after rows
    with larger ones have been acted on."""
    inserted = threading.Barrier(parts)
    turn = [threading.Event() for _ in range(parts)]
    errors: list[BaseException] = []
    pause_s = [*[1.5, 0.4, 0.2, *[0.0] * parts][: parts - 1], 0.0]  # the last commits first

    def writer(part: int) -> None:
        try:
            with transaction.atomic():
                if part:
                    turn[part - 1].wait(10)  # take ids after the previous part
                write(part)
                turn[part].set()
                inserted.wait(10)
                time.sleep(pause_s[part])
        except BaseException as exc:  # reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer, args=(part,)) for part in range(parts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
