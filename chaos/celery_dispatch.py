"""The chaos run's Celery part: dispatch timers in the load, a consumer that logs deliveries.

The load generator (:func:`schedule`) schedules, at a small rate, timers whose effect is a
Celery task message: ``durable.schedule_celery`` as a user calls it, on a queue of the
run's own (``chaos.<seed>.<stamp>.<pid>``), so runs never see each other's messages.
The workers publish them with ``DURABLE["BROKER_URL"]`` set to the run's broker
(RabbitMQ on this machine by default) and durable's own kombu publish path.

:class:`Session` is the orchestrator's side: it asks the broker whether it answers
before anything starts (a broker that does not is an error naming it, never a silent
skip; ``--no-celery`` turns the Celery part off), declares the queue as durable does,
runs a kombu consumer thread that writes every delivered message (task id, the
operation in its args, when it arrived, whether the broker redelivered it) to
``celery.jsonl`` before acking it, waits for the queue to empty after the drain, and
deletes the queue and its exchange at the end. :mod:`chaos.celery_check` checks the
deliveries against the history.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

#: The broker the run publishes to unless ``--celery-broker`` (or CHAOS_CELERY_BROKER) says.
DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672//"
#: The Celery task name the dispatch timers carry (no Celery worker runs it: the run's
#: consumer only records the messages).
TASK = "chaos.dispatched"
#: Share of the load's transactions that schedule a dispatch timer (25/s: about 1 a second).
SHARE = 0.04
#: After the drain, the queue must stay empty this long before the consumer stops.
QUIET_S = 1.0


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
    """The run's queue on the broker, its consumer thread and its ledger file."""

    def __init__(self, url: str, queue: str, ledger: Path) -> None:
        self.url = url
        self.queue = queue
        self.ledger = ledger
        self.count = 0
        self.last_ms = 0
        self.error = ""
        self._lock = threading.Lock()
        self._out = ledger.open("a")
        self._consumer: Any = None
        self._thread: threading.Thread | None = None

    @classmethod
    def open(cls, args: argparse.Namespace, out: Path, stamp: str) -> Session | None:
        """The Celery part of this run, started; None with ``--no-celery``.

        Raises SystemExit naming the broker when it does not answer."""
        if args.no_celery:
            return None
        why = probe(args.celery_broker)
        if why is not None:
            raise SystemExit(
                f"chaos: the Celery broker {redacted(args.celery_broker)} does not answer "
                f"({why}). Start it (.ci/run does), or leave the Celery dispatch out: "
                "make chaos CELERY=0 (python -m chaos --no-celery)."
            )
        queue = f"chaos.{args.seed}.{stamp}.{os.getpid()}"
        session = cls(args.celery_broker, queue, out / "celery.jsonl")
        session.start()
        return session

    def worker_env(self) -> dict[str, str]:
        """What the workers need to publish to the run's broker."""
        return {"DURABLE_BROKER_URL": self.url}

    def load_args(self) -> list[str]:
        """What the load generator needs to schedule dispatch timers on the run's queue."""
        return ["--celery-queue", self.queue]

    def start(self) -> None:
        """Declare the queue (as durable declares it) and start consuming it."""
        from kombu import Connection, Consumer
        from kombu.mixins import ConsumerMixin

        from durable.dispatch.broker import direct_queue

        queue = direct_queue(self.queue)
        with Connection(self.url) as conn:
            queue(conn.default_channel).declare()
        session = self

        class _Consumer(ConsumerMixin):  # reconnects by itself if the connection drops
            def __init__(self) -> None:
                self.connection = Connection(session.url)

            def get_consumers(self, consumer: Any, channel: Any) -> list[Any]:
                del consumer  # the mixin's class; ours needs the channel only
                return [Consumer(channel, [queue], callbacks=[session.on_message], accept=["json"])]

        self._consumer = _Consumer()
        self._thread = threading.Thread(target=self._run, name="celery-ledger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._consumer.run()
        except Exception as exc:  # reported with the verdict: deliveries may be missing
            self.error = f"{type(exc).__name__}: {exc}"

    def on_message(self, body: Any, message: Any) -> None:
        """Write one delivery to the ledger (flushed), then ack it."""
        headers = message.headers or {}
        args = body[0] if isinstance(body, list) and body else []
        entry = {
            "task_id": headers.get("id"),
            "task": headers.get("task"),
            "op": args[0] if args else None,
            "at_ms": time.time_ns() // 1_000_000,
            "redelivered": bool(message.delivery_info.get("redelivered")),
        }
        with self._lock:
            self._out.write(json.dumps(entry, separators=(",", ":")) + "\n")
            self._out.flush()
            self.count += 1
            self.last_ms = entry["at_ms"]
        message.ack()

    def waiting(self) -> int:
        """Messages in the queue not yet delivered to the consumer."""
        from kombu import Connection

        with Connection(self.url) as conn:
            _, count, _ = conn.default_channel.queue_declare(self.queue, passive=True)
            return int(count)

    def finish(self, timeout_s: float = 30.0) -> None:
        """Wait until the queue stays empty for :data:`QUIET_S`, then stop consuming."""
        deadline = time.monotonic() + timeout_s
        quiet_since = None
        while time.monotonic() < deadline and self._thread and self._thread.is_alive():
            try:
                empty = self.waiting() == 0
            except Exception as exc:  # the broker went away: stop waiting for it
                self.error = f"{type(exc).__name__}: {exc}"
                break
            quiet_since = (quiet_since or time.monotonic()) if empty else None
            if quiet_since and time.monotonic() - quiet_since >= QUIET_S:
                break
            time.sleep(0.2)
        self.stop()

    def stop(self) -> None:
        """Stop the consumer thread and close the ledger."""
        if self._consumer is not None:
            self._consumer.should_stop = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self._out.close()

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
        return {
            "broker": redacted(self.url),
            "queue": self.queue,
            "delivered": self.count,
            "error": self.error,
        }


def read_deliveries(path: Path) -> list[dict[str, Any]]:
    """The consumer's ledger (``celery.jsonl``); empty when the run had no Celery part."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
