"""Throwaway PostgreSQL clusters, for tests that stop, restart or break the database.

A test that restarts PostgreSQL must never touch the shared server other tests use, so
:class:`TemporaryCluster` makes its own: ``initdb`` into a fresh directory owned by the
``postgres`` OS user, trust authentication, listening on 127.0.0.1 only, on a free port
(from 55433 up). It runs the server binaries as that user through ``runuser``, which is
why it needs root (as in CI containers); :func:`unavailable_reason` says why a machine
cannot host one, for ``pytest.skip``. Always :meth:`~TemporaryCluster.destroy` it (the
context manager does): it stops the server and deletes the directory.

>>> with TemporaryCluster() as cluster:          # doctest: +SKIP
...     url = cluster.create_database("app")
...     cluster.restart(pause_s=2.0)
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["ClusterError", "TemporaryCluster", "find_bindir", "unavailable_reason"]

#: Where Debian and Ubuntu install the server binaries of PostgreSQL 15.
DEFAULT_BINDIR = Path("/usr/lib/postgresql/15/bin")
OS_USER = "postgres"
FIRST_PORT = 55433


class ClusterError(RuntimeError):
    """A server command of the throwaway cluster failed; the message carries its output."""


def find_bindir() -> Path | None:
    """Directory holding ``initdb`` and ``pg_ctl``: ``$DURABLE_PG_BINDIR``, Debian's, PATH."""
    candidates = [os.environ.get("DURABLE_PG_BINDIR"), str(DEFAULT_BINDIR)]
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(str(Path(on_path).parent))
    for candidate in filter(None, candidates):
        path = Path(candidate)
        if (path / "initdb").is_file() and (path / "pg_ctl").is_file():
            return path
    return None


def unavailable_reason() -> str | None:
    """Why no throwaway cluster can run here (a sentence for ``pytest.skip``), or None."""
    if find_bindir() is None:
        return f"initdb/pg_ctl not found (looked in $DURABLE_PG_BINDIR, {DEFAULT_BINDIR}, PATH)"
    if os.geteuid() != 0:
        return f"needs root to run PostgreSQL as the {OS_USER!r} OS user via runuser"
    if shutil.which("runuser") is None:
        return "runuser not found"
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        return f"no {OS_USER!r} OS user to own the cluster"
    return None


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(first: int = FIRST_PORT, tries: int = 100) -> int:
    """Return the first port from ``first`` that nothing listens on, on 127.0.0.1."""
    for port in range(first, first + tries):
        if _port_is_free(port):
            return port
    raise ClusterError(f"no free port in {first}-{first + tries - 1}")


class TemporaryCluster:
    """A private PostgreSQL server in a temporary directory; see the module docstring."""

    def __init__(self, *, port: int | None = None, bindir: Path | None = None) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise ClusterError(f"cannot run a throwaway cluster: {reason}")
        self.bindir = bindir or find_bindir() or DEFAULT_BINDIR
        self.port = port if port is not None else free_port()
        self.root = Path(tempfile.mkdtemp(prefix="durable-pg-"))
        self.data = self.root / "data"
        self.logfile = self.root / "server.log"
        user = pwd.getpwnam(OS_USER)
        os.chown(self.root, user.pw_uid, user.pw_gid)
        self._initialized = False

    def __repr__(self) -> str:
        return f"TemporaryCluster(port={self.port}, root={str(self.root)!r})"

    # -- server life cycle ---------------------------------------------------------------

    def start(self) -> None:
        """Create the cluster on first use, then start the server and wait until it is up."""
        if not self._initialized:
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                OS_USER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--no-instructions",
            )
            self._initialized = True
        # fsync off: the data are thrown away, and a clean (fast) shutdown still flushes.
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off "
            f"-c unix_socket_directories={self.root}"
        )
        log = str(self.logfile)
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", log, "-w", "-t", "60", "-o", options, "start"
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: roll back sessions and shut down cleanly)."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", mode, "stop")

    def restart(self, pause_s: float = 2.0) -> tuple[float, float]:
        """Stop (fast), stay down ``pause_s``, start; return the monotonic (down, up) times."""
        self.stop("fast")
        down = time.monotonic()
        time.sleep(pause_s)
        self.start()
        return down, time.monotonic()

    @property
    def running(self) -> bool:
        """True when the server's postmaster is alive."""
        if not self._initialized:
            return False
        done = self._run("pg_ctl", "-D", str(self.data), "status", check=False)
        return done.returncode == 0

    def destroy(self) -> None:
        """Stop the server if it runs (immediately) and delete the directory."""
        try:
            if self.running:
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> TemporaryCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    # -- databases -----------------------------------------------------------------------

    def url(self, dbname: str = "postgres") -> str:
        """A ``DATABASE_URL`` for ``dbname`` on this cluster (superuser, trust auth)."""
        return f"postgres://{OS_USER}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, dbname: str) -> str:
        """Create ``dbname`` and return its ``DATABASE_URL``."""
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", OS_USER, dbname)
        return self.url(dbname)

    def query(self, dbname: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement on a fresh connection (survives restarts) and return its rows."""
        import psycopg

        with psycopg.connect(self.url(dbname), connect_timeout=5, autocommit=True) as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description else []

    def server_log(self) -> str:
        """The server's log so far (for assertion messages)."""
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- helpers -------------------------------------------------------------------------

    def _run(
        self, program: str, *args: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        command = ["runuser", "-u", OS_USER, "--", str(self.bindir / program), *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise ClusterError(
                f"{program} failed ({done.returncode}): {done.stderr.strip() or done.stdout}\n"
                f"server log:\n{self.server_log()[-4000:]}"
            )
        return done
