"""Real ``run_timer_shards`` processes for acceptance tests, and polling with deadlines.

:class:`WorkerPool` starts workers as ``manage.py run_timer_shards --node NAME``
subprocesses, logs each to a file, and stops them all (SIGTERM, then SIGKILL) when the
test ends. Tests never sleep for fixed long times: :meth:`WorkerPool.wait_until` polls a
condition with a deadline and fails with every worker's log attached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from django.db.models import Count, F

from durable.conf import DurableSettings
from durable.models import ShardLease, Timer
from testproject.demo.models import FireRecord

REPO_ROOT = Path(__file__).resolve().parents[2]
# The workers run durable's default settings (acceptance tests use defaults unless a
# test is about a setting); these name them for the tests' deadlines.
_DEFAULTS = DurableSettings()
SHARDS = _DEFAULTS.SHARDS
LEASE_TTL_S = _DEFAULTS.LEASE_TTL_S
RESCAN_INTERVAL_S = _DEFAULTS.RESCAN_INTERVAL_S
BATCH_TIME_BUDGET_S = _DEFAULTS.BATCH_TIME_BUDGET_S
LOG_TAIL_LINES = 60


def now_ms() -> int:
    """Wall-clock epoch milliseconds (what the workers' clocks read on this machine)."""
    return time.time_ns() // 1_000_000


def app_name(worker: str) -> str:
    """The PostgreSQL ``application_name`` of a worker's sessions."""
    return f"durable-worker-{worker}"


def database_url(settings_dict: dict[str, Any]) -> str:
    """A ``DATABASE_URL`` for the database Django is connected to (the test database)."""
    engine = settings_dict["ENGINE"]
    name = settings_dict["NAME"]
    if engine.endswith("sqlite3"):
        return f"sqlite:///{Path(name).resolve()}"  # sqlite:////abs/path
    if engine.endswith("postgresql"):
        user = quote(settings_dict.get("USER") or "", safe="")
        password = quote(settings_dict.get("PASSWORD") or "", safe="")
        auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
        host = settings_dict.get("HOST") or "127.0.0.1"
        port = settings_dict.get("PORT") or 5432
        return f"postgres://{auth}{host}:{port}/{quote(name, safe='')}"
    raise ValueError(f"no DATABASE_URL form for {engine}")


@dataclass
class Worker:
    """One ``run_timer_shards`` subprocess and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    @property
    def alive(self) -> bool:
        """True while the process has not exited (a stopped process is alive)."""
        return self.proc.poll() is None

    def send(self, signum: int) -> None:
        """Send ``signum`` to the worker."""
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the worker and reap it."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (and SIGCONT, in case it is frozen), then SIGKILL after ``timeout_s``."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if not self.log_file.closed:
            self.log_file.close()
        return self.proc.returncode

    def log(self) -> str:
        """Everything the worker logged so far."""
        return self.log_path.read_text(errors="replace")

    def events(self, name: str) -> list[str]:
        """Log lines of structured event ``name`` (e.g. ``"lease.takeover"``)."""
        return [line for line in self.log().splitlines() if f" {name} " in f"{line} "]

    def leases_taken(self) -> set[tuple[int, int]]:
        """Every ``(shard, token)`` this worker acquired or took over, from its log."""
        taken = set()
        for line in self.events("lease.acquired") + self.events("lease.takeover"):
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            taken.add((int(fields["shard"]), int(fields["token"])))
        return taken


class WorkerPool:
    """Starts workers against one database and stops every one of them at the end."""

    def __init__(
        self,
        *,
        database_url: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        defaults: bool = False,
    ):
        """``defaults``: the workers run durable's default settings (no tuning for tests)."""
        self.database_url = database_url
        self.log_dir = log_dir
        tuning = {
            "DURABLE_SHARDS": str(SHARDS),
            "DURABLE_LEASE_TTL_S": str(LEASE_TTL_S),
            "DURABLE_RESCAN_INTERVAL_S": str(RESCAN_INTERVAL_S),
            "DURABLE_BATCH_TIME_BUDGET_S": str(BATCH_TIME_BUDGET_S),
        }
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_")}
        self.env = {
            **inherited,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "DATABASE_URL": database_url,
            **({} if defaults else tuning),
            "DURABLE_LOG_LEVEL": "INFO",
            # The handlers and workflows these tests fire live under tests/, not in an app.
            "DURABLE_IMPORTS": "tests.acceptance.handlers,tests.acceptance.workflows",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.workers: dict[str, Worker] = {}

    def start(self, name: str, *args: str) -> Worker:
        """Start ``manage.py run_timer_shards --node name`` (a restart appends to its log).

        Its database sessions carry ``application_name`` ``durable-worker-<name>``
        (``PGAPPNAME``), so a test can find them in ``pg_stat_activity``.
        """
        old = self.workers.get(name)
        if old is not None and old.alive:
            raise RuntimeError(f"worker {name} is still running")
        log_path = self.log_dir / f"worker-{name}.log"
        log_file = log_path.open("ab")
        command = [sys.executable, "manage.py", "run_timer_shards", "--node", name, *args]
        try:
            proc = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env={**self.env, "PGAPPNAME": app_name(name)},
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        except BaseException:
            log_file.close()
            raise
        worker = Worker(name=name, proc=proc, log_path=log_path, log_file=log_file)
        if old is not None:
            old.stop()
        self.workers[name] = worker
        return worker

    def stop_all(self) -> None:
        """Stop every worker started by this pool."""
        for worker in self.workers.values():
            worker.stop()

    def logs(self, tail: int = LOG_TAIL_LINES) -> str:
        """The last ``tail`` lines of every worker's log, for assertion messages."""
        parts = []
        for worker in self.workers.values():
            lines = worker.log().splitlines()[-tail:]
            state = "running" if worker.alive else f"exited {worker.proc.returncode}"
            parts.append(f"--- worker {worker.name} ({state}), {worker.log_path}:")
            parts.extend(lines)
        return "\n".join(parts)

    def wait_until(
        self,
        predicate: Callable[[], Any],
        *,
        timeout_s: float,
        what: str,
        interval_s: float = 0.05,
        require_alive: Iterable[str] = (),
        explain: Callable[[], object] | None = None,
    ) -> float:
        """Poll ``predicate`` until it is truthy; return the seconds it took.

        Fails with ``what``, the predicate's last value, ``explain()`` and the workers'
        logs when the deadline passes or when a worker in ``require_alive`` exits.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        value: Any = None
        while True:
            value = predicate()
            if value:
                return time.monotonic() - start
            for name in require_alive:
                if not self.workers[name].alive:
                    raise AssertionError(
                        f"worker {name} exited while waiting for {what}\n{self.logs()}"
                    )
            if time.monotonic() >= deadline:
                details = f"\n{explain()}" if explain is not None else ""
                raise AssertionError(
                    f"timed out after {timeout_s:.1f}s waiting for {what} (last: {value!r})"
                    f"{details}\n{self.logs()}"
                )
            time.sleep(interval_s)


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
