"""Procrastinate's side of the timer benchmark: scheduled jobs and a worker, in-process.

Configured for throughput the way its docs suggest: async tasks (no thread per job),
``concurrency`` (8) sub-workers sharing a psycopg pool with one more connection than
sub-workers, ``listen_notify=True`` (new jobs wake the worker at once) and
``fetch_job_polling_interval`` of 0.1 s, the same as the naive poller's, because a job
scheduled for later is announced when it is deferred, not when it comes due: only the
polling notices it then. Jobs are kept after success (``delete_jobs="never"``, the
default), as durable keeps fired rows.

Each job carries its due time (epoch ms) as an argument, so lateness is measured the same
way as for durable: the wall clock when the task starts, minus the due time.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench._common import Recorder, connect, wall_ms

RECORDER = Recorder()
CONCURRENCY = 8
POLL_S = 0.1
QUEUE = "bench"


def make_app(url: str, *, pool_size: int = 4) -> Any:
    """A Procrastinate app on ``url`` with the two benchmark tasks registered."""
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(
            conninfo=url, min_size=pool_size, max_size=pool_size
        )
    )

    @app.task(name="noop", queue=QUEUE)
    async def noop(due_ms: float) -> None:
        RECORDER.events.append((due_ms, wall_ms()))

    @app.task(name="write", queue=QUEUE, pass_context=True)
    async def write(context: Any, ref: int, due_ms: float) -> None:
        fired = wall_ms()
        await context.app.connector.execute_query_async(
            "INSERT INTO bench_effect (ref, due_ms, fired_ms) VALUES (%(r)s, %(d)s, %(f)s)",
            r=ref,
            d=int(due_ms),
            f=fired,
        )
        RECORDER.events.append((due_ms, fired))

    return app


def prepare(url: str) -> None:
    """Create Procrastinate's schema (once) and the effect table; empty both."""
    with connect(url) as conn:
        exists = conn.execute("SELECT to_regclass('procrastinate_jobs')").fetchone()[0]
    if exists is None:
        app = make_app(url)
        with app.open():
            app.schema_manager.apply_schema()
    with connect(url) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_effect "
            "(ref bigint NOT NULL, due_ms bigint NOT NULL, fired_ms double precision NOT NULL)"
        )
        conn.execute(
            "TRUNCATE procrastinate_jobs, procrastinate_events, procrastinate_periodic_defers,"
            " procrastinate_workers, bench_effect CASCADE"
        )
        conn.execute("VACUUM ANALYZE procrastinate_jobs")


def insert_far(url: str, n: int, days: float = 30) -> float:
    """Insert ``n`` jobs scheduled ``days`` out with generate_series (the 1M-pending set-up).

    User triggers (NOTIFY and event rows per job) are disabled for this insert only: the
    jobs never run during the benchmark, so their events would be dead weight.
    """
    started = time.perf_counter()
    with connect(url, autocommit=False) as conn:
        conn.execute("ALTER TABLE procrastinate_jobs DISABLE TRIGGER USER")
        conn.execute(
            "INSERT INTO procrastinate_jobs (queue_name, task_name, args, status, scheduled_at)"
            " SELECT %s, 'noop', jsonb_build_object('due_ms', 0), 'todo',"
            " now() + make_interval(days => %s) + i * interval '1 ms'"
            " FROM generate_series(1, %s) AS i",
            [QUEUE, days, n],
        )
        conn.execute("ALTER TABLE procrastinate_jobs ENABLE TRIGGER USER")
        conn.commit()
        conn.execute("ANALYZE procrastinate_jobs")
    return time.perf_counter() - started


def _dt(ms: float) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


class Scheduler:
    """Defers jobs from the calling thread with a synchronously opened app."""

    def __init__(self, url: str) -> None:
        self.app = make_app(url, pool_size=2)
        self.app.open()

    def close(self) -> None:
        """Close the app's pool."""
        self.app.close()

    def defer_one_per_transaction(self, n: int, due_ms: float) -> float:
        """``task.configure(schedule_at=...).defer()`` n times; return the seconds."""
        task = self.app.tasks["noop"]
        at = _dt(due_ms)
        started = time.perf_counter()
        for _ in range(n):
            task.configure(schedule_at=at).defer(due_ms=due_ms)
        return time.perf_counter() - started

    def batch_defer(self, n: int, due_ms: float, chunk: int = 10_000) -> float:
        """``task.configure(schedule_at=...).batch_defer(...)`` in chunks; return the seconds."""
        task = self.app.tasks["noop"]
        at = _dt(due_ms)
        started = time.perf_counter()
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            task.configure(schedule_at=at).batch_defer(*({"due_ms": due_ms},) * size)
        return time.perf_counter() - started

    def defer_at(self, due_ms: Sequence[float], task: str = "noop", chunk: int = 5_000) -> float:
        """Defer one job per due time (each with its own ``scheduled_at``), in batches.

        ``batch_defer`` applies one ``schedule_at`` to a whole batch, so jobs with distinct
        due times go through the job manager's ``batch_defer_jobs`` (what it calls).
        """
        from procrastinate.jobs import Job

        started = time.perf_counter()
        for start in range(0, len(due_ms), chunk):
            jobs = []
            for i, ms in enumerate(due_ms[start : start + chunk], start):
                kwargs: dict[str, Any] = {"due_ms": ms}
                if task == "write":
                    kwargs["ref"] = i
                jobs.append(
                    Job(
                        queue=QUEUE,
                        task_name=task,
                        task_kwargs=kwargs,
                        scheduled_at=_dt(ms),
                        lock=None,
                        queueing_lock=None,
                    )
                )
            self.app.job_manager.batch_defer_jobs(jobs)
        return time.perf_counter() - started


class WorkerThread:
    """``app.run_worker_async`` on its own event loop in a thread of this process."""

    def __init__(self, url: str, *, concurrency: int = CONCURRENCY, poll_s: float = POLL_S):
        self.url = url
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task[Any] | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="procrastinate", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        app = make_app(self.url, pool_size=self.concurrency + 1)
        async with app.open_async():
            self.loop = asyncio.get_running_loop()
            self.task = asyncio.create_task(
                app.run_worker_async(
                    queues=[QUEUE],
                    concurrency=self.concurrency,
                    listen_notify=True,
                    fetch_job_polling_interval=self.poll_s,
                    install_signal_handlers=False,
                    wait=True,
                )
            )
            self.ready.set()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    def start(self) -> None:
        """Start the worker and wait until its loop runs."""
        self.thread.start()
        if not self.ready.wait(30):
            raise RuntimeError("procrastinate worker did not start")
        time.sleep(0.5)  # let it register and LISTEN

    def stop(self) -> None:
        """Cancel the worker task (a graceful stop) and wait for the thread."""
        if self.loop is not None and self.task is not None:
            self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout=60)


def done_count(url: str) -> int:
    """Jobs that finished successfully."""
    with connect(url) as conn:
        return int(
            conn.execute(
                "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
            ).fetchone()[0]
        )
