"""The chaos run's Celery part: dispatch timers in the load, a stock Celery worker running them.

The load generator (:func:`schedule`) schedules, at a small rate, timers whose effect is a
Celery task message: ``durable.schedule_celery`` as a user calls it, on a queue of the
run's own (``chaos.<seed>.<stamp>.<pid>``), so runs never see each other's messages.
The workers publish them with ``DURABLE["BROKER_URL"]`` set to the run's broker
(RabbitMQ on this machine by default) and durable's own kombu publish path.

:class:`Session` is the orchestrator's side: it asks the broker whether it answers
before anything starts (a broker that does not is an error naming it, never a silent
skip; ``--no-celery`` turns the Celery part off), declares the queue as durable and
Celery do, and starts a stock ``celery worker`` on it (``testproject.celery_app``, a
thread pool of 2, acks after running) whose ``testproject.record`` task appends each run
(task id, the operation in its args, when it ran) to ``executions.jsonl``. After the
drain it waits for the queue to empty and the worker to go quiet, stops the worker,
and deletes the queue and its exchange. :mod:`chaos.celery_check` checks the runs
against the history.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: The broker the run publishes to unless ``--celery-broker`` (or CHAOS_CELERY_BROKER) says.
DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672//"
#: The Celery task the dispatch timers send: the test project's Celery app records each
#: run of it (task id, first argument, when) in ``executions.jsonl``.
TASK = "testproject.record"
#: Share of the load's transactions that schedule a dispatch timer (25/s: about 1 a second).
SHARE = 0.04
#: After the drain, the queue must stay empty and the worker idle this long before it stops.
QUIET_S = 1.5
REPO = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The run's Celery options."""
    parser.add_argument(
        "--celery-broker",
        default=os.environ.get("CHAOS_CELERY_BROKER", DEFAULT_BROKER),
        help="broker of the Celery dispatch load (default: RabbitMQ on 127.0.0.1:5672)",
    )
    parser.add_argument(
        "--no-celery",
        action="store_true",
        help="leave the Celery dispatch out of the load (otherwise an unreachable broker "
        "stops the run)",
    )


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def probe(url: str, timeout_s: float = 5.0) -> str | None:
    """None if the broker at ``url`` answers, else why not."""
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=timeout_s) as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout_s)
    except Exception as exc:  # any failure to connect is the answer
        return f"{type(exc).__name__}: {exc}"
    return None


# -- the load's side --------------------------------------------------------------------


def share(gen: Any) -> float:
    """The share of ``gen``'s transactions that schedule a dispatch timer: none without a
    queue (``gen.celery_queue``)."""
    return SHARE if gen.celery_queue else 0.0


def schedule(gen: Any) -> None:
    """One dispatch timer in a transaction of ``gen`` (a :class:`chaos.load.Generator`)
    on its ``celery_queue``: due within 3 s, rolled back 10 % of the time, keyed 30 %,
    cancelled later 15 %."""
    import durable

    rng, queue = gen.rng, gen.celery_queue
    op = gen.op_id("c")
    delay_ms = rng.randint(0, 3000)
    record: dict[str, Any] = {"kind": "celery", "op": op, "queue": queue}
    record["rollback"] = rng.random() < 0.1
    if rng.random() < 0.3:
        record["key"] = f"k-{op}"

    def body() -> dict[str, Any]:
        timer = durable.schedule_celery(
            TASK,
            args=[op],
            delay=timedelta(milliseconds=delay_ms),
            key=record.get("key"),
            queue=queue,
        )
        return {"timer_id": timer.pk, "due_ms": timer.fire_at_ms}

    if gen.run_txn(record, body) and rng.random() < 0.15:
        timer_id = record["timer_id"]
        gen.defer(rng.uniform(0, 2.0), lambda: gen.cancel(op, timer_id))


# -- the orchestrator's side ------------------------------------------------------------


class Session:
    """The run's queue on the broker and the stock Celery worker that consumes it."""

    def __init__(self, url: str, queue: str, out: Path) -> None:
        self.url = url
        self.queue = queue
        self.out = out
        self.error = ""
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def open(cls, args: argparse.Namespace, out: Path, stamp: str) -> Session | None:
        """The Celery part of this run, started; None with ``--no-celery``.

        Raises SystemExit naming the broker when it does not answer, and naming the
        Celery worker's log when the worker does not start consuming."""
        if args.no_celery:
            return None
        why = probe(args.celery_broker)
        if why is not None:
            raise SystemExit(
                f"chaos: the Celery broker {redacted(args.celery_broker)} does not answer "
                f"({why}). Start it (.ci/run does), or leave the Celery dispatch out: "
                "make chaos CELERY=0 (python -m chaos --no-celery)."
            )
        session = cls(args.celery_broker, f"chaos.{args.seed}.{stamp}.{os.getpid()}", out)
        try:
            session.start()
        except BaseException:
            session.stop()
            session.close()
            raise
        return session

    def worker_env(self) -> dict[str, str]:
        """What the durable workers need to publish to the run's broker."""
        return {"DURABLE_BROKER_URL": self.url}

    def load_args(self) -> list[str]:
        """What the load generator needs to schedule dispatch timers on the run's queue."""
        return ["--celery-queue", self.queue]

    def start(self, timeout_s: float = 60.0) -> None:
        """Declare the queue (as durable and Celery declare it), start a Celery worker on
        it and wait until it consumes."""
        from kombu import Connection

        from durable.dispatch.broker import direct_queue

        with Connection(self.url) as conn:
            direct_queue(self.queue)(conn.default_channel).declare()
        log = (self.out / "celery-worker.log").open("ab")
        command = [
            *(sys.executable, "-m", "celery", "-A", "testproject.celery_app", "worker"),
            *("-Q", self.queue, "-P", "threads", "-c", "2", "-l", "INFO"),
            *("-n", f"{self.queue}@%h", "--without-gossip", "--without-mingle"),
            "--without-heartbeat",
        ]
        env = {**os.environ, "CELERY_BROKER_URL": self.url, "CELERY_OUT_DIR": str(self.out)}
        env["PYTHONUNBUFFERED"] = "1"
        self._proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()  # the child has its own descriptor
        deadline = time.monotonic() + timeout_s
        while self._state()[1] < 1:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"chaos: the Celery worker on queue {self.queue} did not start consuming "
                    f"within {timeout_s:g} s (exit {self._proc.poll()}); see "
                    f"{self.out}/celery-worker.log"
                )
            time.sleep(0.2)

    def _state(self) -> tuple[int, int]:
        """(messages waiting in the queue, consumers of it)."""
        from kombu import Connection

        with Connection(self.url) as conn:
            _, waiting, consumers = conn.default_channel.queue_declare(self.queue, passive=True)
            return int(waiting), int(consumers)

    def finish(self, timeout_s: float = 30.0) -> None:
        """Wait until the queue is empty and the worker has run nothing new for
        :data:`QUIET_S` (it acks after running, so prefetched messages are not lost),
        then stop the worker."""
        deadline = time.monotonic() + timeout_s
        seen, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline and self._proc and self._proc.poll() is None:
            try:
                waiting, _ = self._state()
            except Exception as exc:  # the broker went away: stop waiting for it
                self.error = f"{type(exc).__name__}: {exc}"
                break
            ran = len(read_deliveries(self.out))
            if waiting or ran != seen:
                seen, quiet_since = ran, time.monotonic()
            elif time.monotonic() - quiet_since >= QUIET_S:
                break
            time.sleep(0.2)
        if self._proc is not None and self._proc.poll() is not None and not self.error:
            self.error = f"the Celery worker exited {self._proc.returncode} during the run"
        self.stop()

    def stop(self) -> None:
        """Stop the Celery worker: TERM (its warm shutdown), then KILL."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        """Delete the run's queue and exchange (runs leave nothing on the broker)."""
        from kombu import Connection

        try:
            with Connection(self.url) as conn:
                channel = conn.default_channel
                channel.queue_delete(self.queue)
                channel.exchange_delete(self.queue)
        except Exception as exc:  # worth saying, not worth failing a finished run over
            print(f"chaos: could not delete Celery queue {self.queue}: {exc}")

    def summary(self) -> dict[str, Any]:
        """What the report says about the Celery part."""
        return {"broker": redacted(self.url), "queue": self.queue, "error": self.error}


def read_deliveries(out: Path) -> list[dict[str, Any]]:
    """Each run of the task by the Celery worker (``executions.jsonl`` in ``out``, written
    by :func:`testproject.celery_app.record`): task id, operation and when it ran. Empty
    when the run had no Celery part."""
    from testproject.celery_app import read_executions

    return [
        {"task_id": run["task_id"], "op": run["key"], "at_ms": run["ran_ms"]}
        for run in read_executions(out)
    ]
