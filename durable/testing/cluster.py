"""Throwaway PostgreSQL clusters and PgBouncers, for tests of production topologies.

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

:class:`TemporaryPgBouncer` puts PgBouncer (transaction pooling by default) in front of a
server, in its own directory and on its own port, run as the ``postgres`` OS user when
started as root (PgBouncer refuses root); :meth:`~TemporaryPgBouncer.url` gives the
pooled ``DATABASE_URL`` of any database of that server.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "ClusterError",
    "TemporaryCluster",
    "TemporaryPgBouncer",
    "find_bindir",
    "pgbouncer_unavailable_reason",
    "unavailable_reason",
]

#: Where Debian and Ubuntu install the server binaries of PostgreSQL 15.
DEFAULT_BINDIR = Path("/usr/lib/postgresql/15/bin")
OS_USER = "postgres"
FIRST_PORT = 55433
#: Where Debian installs PgBouncer.
PGBOUNCER = Path("/usr/sbin/pgbouncer")


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

    def __init__(
        self, *, port: int | None = None, bindir: Path | None = None, options: str = ""
    ) -> None:
        """``options``: more server options for ``pg_ctl start -o`` (``-c name=value ...``)."""
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
        self.options = options

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
            f"-c unix_socket_directories={self.root} {self.options}"
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

    def start_standby_of(self, primary: TemporaryCluster, name: str) -> None:
        """Become a streaming replica of ``primary`` (``pg_basebackup -R``) and start.

        The replica connects as ``application_name`` ``name`` (its ``cluster_name``), the
        name the primary's ``synchronous_standby_names`` can list.
        """
        if self._initialized:
            raise ClusterError("a standby is made from a fresh TemporaryCluster")
        self._run(
            "pg_basebackup",
            *("-D", str(self.data), "-h", "127.0.0.1", "-p", str(primary.port)),
            *("-U", OS_USER, "-R", "-X", "stream", "--no-sync", "--checkpoint=fast"),
        )
        self._initialized = True
        self.options = f"{self.options} -c cluster_name={name}"
        self.start()

    def promote(self) -> None:
        """Promote this standby to a primary and wait until it accepts writes."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

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


def find_pgbouncer() -> Path | None:
    """The ``pgbouncer`` binary: ``$DURABLE_PGBOUNCER``, Debian's, or PATH."""
    candidates = [os.environ.get("DURABLE_PGBOUNCER"), str(PGBOUNCER), shutil.which("pgbouncer")]
    for candidate in filter(None, candidates):
        if Path(candidate).is_file():
            return Path(candidate)
    return None


def pgbouncer_unavailable_reason() -> str | None:
    """Why no :class:`TemporaryPgBouncer` can run here (for ``pytest.skip``), or None."""
    if find_pgbouncer() is None:
        return f"pgbouncer not found (looked in $DURABLE_PGBOUNCER, {PGBOUNCER}, PATH)"
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            return "runuser not found (PgBouncer refuses to run as root)"
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            return f"no {OS_USER!r} OS user to run PgBouncer as (it refuses root)"
    return None


class TemporaryPgBouncer:
    """PgBouncer in front of ``server_host:server_port``, in a temporary directory.

    Every database of the server is reachable under its own name (``* =``), clients
    authenticate by trust, and PgBouncer logs in to the server with the passwords in
    ``users`` (user -> password, ``""`` for trust). ``pool_size`` server connections per
    database and user: 1 makes every client share one server connection.
    """

    def __init__(
        self,
        *,
        server_host: str = "127.0.0.1",
        server_port: int = 5432,
        users: dict[str, str] | None = None,
        pool_size: int = 20,
        pool_mode: str = "transaction",
        port: int | None = None,
    ) -> None:
        reason = pgbouncer_unavailable_reason()
        if reason is not None:
            raise ClusterError(f"cannot run a throwaway PgBouncer: {reason}")
        self.binary = find_pgbouncer() or PGBOUNCER
        self.port = port if port is not None else free_port(first=FIRST_PORT + 1000)
        self.root = Path(tempfile.mkdtemp(prefix="durable-pgbouncer-"))
        self.logfile = self.root / "pgbouncer.log"
        self.pidfile = self.root / "pgbouncer.pid"
        users = users if users is not None else {OS_USER: ""}
        (self.root / "users.txt").write_text(
            "".join(f'"{user}" "{password}"\n' for user, password in users.items())
        )
        (self.root / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={server_host} port={server_port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.root / 'users.txt'}\n"
            f"pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\n"
            "max_client_conn = 1000\n"
            f"logfile = {self.logfile}\npidfile = {self.pidfile}\n"
        )
        self.root.chmod(0o755)
        if os.geteuid() == 0:
            user = pwd.getpwnam(OS_USER)
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"TemporaryPgBouncer(port={self.port}, root={str(self.root)!r})"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start PgBouncer in the foreground (a child of this process); wait until it listens."""
        command = [str(self.binary), str(self.root / "pgbouncer.ini")]
        if os.geteuid() == 0:
            command = ["runuser", "-u", OS_USER, "--", *command]
        self._proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.root
        )
        deadline = time.monotonic() + timeout_s
        while _port_is_free(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"pgbouncer did not start:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def url(self, dbname: str, user: str = OS_USER, password: str = "") -> str:
        """The pooled ``DATABASE_URL`` of ``dbname`` (a database of the server)."""
        auth = f"{user}:{password}@" if password else f"{user}@"
        return f"postgres://{auth}127.0.0.1:{self.port}/{dbname}"

    def log(self) -> str:
        """PgBouncer's log so far (for assertion messages)."""
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def destroy(self) -> None:
        """Stop PgBouncer (SIGTERM to the pid it wrote, then to our child) and delete the dir."""
        try:
            if self._proc is not None and self._proc.poll() is None:
                try:
                    pid: int | None = int(self.pidfile.read_text().strip())
                except (OSError, ValueError):
                    pid = None
                if pid is not None:  # runuser exits (and reaps it) once PgBouncer has
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)
                else:
                    self._proc.terminate()
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=10)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> TemporaryPgBouncer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()
