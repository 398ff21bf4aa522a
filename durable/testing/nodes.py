"""Real ``run_timer_shards`` worker processes for tests and benchmarks: start, kill, freeze.

:class:`WorkerPool` starts workers as ``manage.py run_timer_shards --node NAME [ARGS]``
subprocesses of a project (its ``manage.py`` directory, a settings module, a database
URL), each logging to its own file. A test can SIGKILL one (:meth:`WorkerPool.kill`),
freeze and thaw it (SIGSTOP/SIGCONT: :meth:`~WorkerPool.freeze`, :meth:`~WorkerPool.thaw`),
restart it with the options it was started with (:meth:`~WorkerPool.restart`), and read
its structured events back from its log. Every worker is stopped when the pool is closed
(SIGCONT, SIGTERM, then SIGKILL after a grace period), also when the test fails: use the
pool as a context manager or call :meth:`~WorkerPool.stop_all` in a ``finally``.

>>> with WorkerPool(database_url=url, log_dir=tmp, cwd=project) as pool:   # doctest: +SKIP
...     pool.start("n1", "--raft-self", "127.0.0.1:7100")
...     pool.kill("n1"); pool.restart("n1")

:meth:`WorkerPool.wait_until` polls a condition with a deadline and fails with every
worker's log attached; tests never sleep for fixed long times.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any
from urllib.parse import quote

__all__ = [
    "LOG_TAIL_LINES",
    "Worker",
    "WorkerPool",
    "app_name",
    "database_url",
    "raft_unavailable_reason",
]

#: Lines of each worker's log that :meth:`WorkerPool.logs` shows in a failure message.
LOG_TAIL_LINES = 60


def app_name(worker: str) -> str:
    """The PostgreSQL ``application_name`` of a worker's sessions."""
    return f"durable-worker-{worker}"


def database_url(settings_dict: dict[str, Any]) -> str:
    """A ``DATABASE_URL`` for a Django database settings dict (e.g. the test database)."""
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


def raft_unavailable_reason() -> str | None:
    """Why workers of this checkout cannot run with ``DURABLE["RAFT"]`` (None: they can).

    A sentence naming what is missing, for ``pytest.skip`` and the benchmark's output.
    """
    package = Path(__file__).resolve().parents[1]
    if importlib.util.find_spec("durable.raft") is None:
        return "durable.raft is not in this checkout (the Raft layer is not merged)"
    for module in ("pysyncobj", "cryptography"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'django-durable[raft]')"
    command = (package / "management" / "commands" / "run_timer_shards.py").read_text()
    if "--raft-self" not in command:
        return "run_timer_shards has no --raft-self option yet"
    worker = " ".join(p.read_text() for p in (package / "worker").glob("*.py"))
    if "raft" not in worker.lower():
        return "the worker does not use durable.raft yet (leases ignore Raft leadership)"
    return None


@dataclass
class Worker:
    """One ``run_timer_shards`` subprocess, the options it was started with, its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        """True while the process has not exited (a stopped process is alive)."""
        return self.proc.poll() is None

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def send(self, signum: int) -> None:
        """Send ``signum`` to the worker."""
        self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the worker and reap it: no lease release, no clean-up of any kind."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def freeze(self) -> None:
        """SIGSTOP: the process keeps its sockets and sessions but runs nothing."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        self.proc.send_signal(signal.SIGCONT)

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
        """Everything the worker logged so far (every run of it, when it was restarted)."""
        return self.log_path.read_text(errors="replace")

    def events(self, name: str) -> list[str]:
        """Log lines of structured event ``name`` (e.g. ``"lease.takeover"``)."""
        return [line for line in self.log().splitlines() if f" {name} " in f"{line} "]

    def leases_taken(self) -> set[tuple[int, int]]:
        """Every ``(shard, token)`` this worker acquired or took over (also as a Raft
        leader: ``lease.raft_takeover``), from its log."""
        taken = set()
        for line in (
            self.events("lease.acquired")
            + self.events("lease.takeover")
            + self.events("lease.raft_takeover")
        ):
            fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
            taken.add((int(fields["shard"]), int(fields["token"])))
        return taken


class WorkerPool:
    """Starts workers of one project against one database; stops every one of them at the end.

    ``cwd`` is the directory holding the project's ``manage.py``; ``settings_module`` its
    ``DJANGO_SETTINGS_MODULE``; ``env`` is added to this process's environment without
    its ``DURABLE_*`` variables (a worker reads only what the caller passes on).
    """

    def __init__(
        self,
        *,
        database_url: str,
        log_dir: Path,
        cwd: Path,
        settings_module: str = "testproject.settings",
        env: dict[str, str] | None = None,
        manage: str = "manage.py",
    ):
        self.database_url = database_url
        self.log_dir = Path(log_dir)
        self.cwd = Path(cwd)
        self.manage = manage
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("DURABLE_")}
        self.env = {
            **inherited,
            "DJANGO_SETTINGS_MODULE": settings_module,
            "DATABASE_URL": database_url,
            "DURABLE_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        self.workers: dict[str, Worker] = {}

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Worker:
        """Start ``manage.py run_timer_shards --node name *args`` (a restart appends to its log).

        ``env`` is added for this worker only. Its database sessions carry
        ``application_name`` ``durable-worker-<name>`` (``PGAPPNAME``), so a test can find
        them in ``pg_stat_activity``.
        """
        old = self.workers.get(name)
        if old is not None and old.alive:
            raise RuntimeError(f"worker {name} is still running")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"worker-{name}.log"
        log_file = log_path.open("ab")
        command = [sys.executable, self.manage, "run_timer_shards", "--node", name, *args]
        own_env = dict(env or {})
        try:
            proc = subprocess.Popen(
                command,
                cwd=self.cwd,
                env={**self.env, "PGAPPNAME": app_name(name), **own_env},
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        except BaseException:
            log_file.close()
            raise
        worker = Worker(name, proc, log_path, log_file, tuple(args), own_env)
        if old is not None:
            old.stop()
        self.workers[name] = worker
        return worker

    def restart(self, name: str, *, stop_timeout_s: float = 15.0) -> Worker:
        """Stop ``name`` if it runs (SIGTERM, then SIGKILL), and start it with its options."""
        old = self.workers[name]
        old.stop(timeout_s=stop_timeout_s)
        return self.start(name, *old.args, env=old.env)

    def kill(self, name: str) -> Worker:
        """SIGKILL ``name`` and reap it; :meth:`restart` brings it back."""
        worker = self.workers[name]
        worker.kill()
        return worker

    def freeze(self, name: str) -> Worker:
        """SIGSTOP ``name`` (:meth:`thaw` resumes it)."""
        worker = self.workers[name]
        worker.freeze()
        return worker

    def thaw(self, name: str) -> Worker:
        """SIGCONT ``name``."""
        worker = self.workers[name]
        worker.thaw()
        return worker

    def alive(self) -> list[str]:
        """Names of the workers still running (frozen ones count)."""
        return [name for name, worker in self.workers.items() if worker.alive]

    def stop_all(self) -> None:
        """Stop every worker started by this pool (each one even if another fails)."""
        errors = []
        for worker in self.workers.values():
            try:
                worker.stop()
            except Exception as exc:  # keep stopping the others; report at the end
                errors.append(f"{worker.name}: {exc!r}")
        if errors:
            raise RuntimeError(f"could not stop every worker: {errors}")

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
