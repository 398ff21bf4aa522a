"""``DISPATCH = "kombu"``: fired handlers run in executor processes, fed through kombu.

With the default ``"inline"``, the timer worker runs handlers itself. With ``"kombu"``
the worker only decides *what* is due: it claims the timer (state ``firing`` with a claim
deadline, attempt counted, exactly as for an ``atomic=False`` handler), commits, and
ships a small :class:`Shipment` (timer id, attempt, shard, lease token) to the durable
queue :data:`QUEUE` on ``DURABLE["BROKER_URL"]``. ``python manage.py
run_durable_executor`` consumes it, runs the handler and commits the completion itself.

An executor marks the claim taken (``claim_token`` negated, committed) before it runs the
handler; a message redelivered after that executor died finds the mark and records the
attempt as failed instead of running it again, so a handler that kills its process takes
down at most ``max_attempts`` executors, as in the worker.

The row stays the truth; the message is only a pointer to it. Every completion is fenced
on the claim: it commits only if the row is still ``firing`` with the shipped attempt
number, under a row lock. So a message redelivered after an executor crash, or one
overtaken by a re-fire after the claim expired (``CLAIM_TIMEOUT_S``), finds a different
attempt and is dropped as stale; nothing completes twice.

- Atomic handlers run *inside* that fenced transaction (in a savepoint), so their effect
  on the database still happens exactly once.
- ``atomic=False`` handlers run outside any transaction (at least once), then the
  completion transaction checks the claim.
- A handler that raises is retried at now + backoff, or dead-lettered (at once for
  ``durable.GiveUp`` and the handler's ``give_up_on``/``retry_on``), as in the worker;
  the retry reaches the owning worker by NOTIFY (PostgreSQL) or its rescan.
- A shipment that cannot be published (broker down) counts as a failed attempt of the
  timer: retried with backoff, never lost.

``memory://`` (the default ``BROKER_URL``) only reaches consumers in the same process:
the worker then runs an :class:`EmbeddedExecutor` thread (tests use the same).

This module ships shipments and consumes the queue; executing one (the fenced
completion) is :mod:`durable.dispatch.execution`, whose names it re-exports.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.db import (
    InterfaceError,
    OperationalError,
    close_old_connections,
    transaction,
)
from kombu import Connection, Message

from durable.core.clock import Clock
from durable.core.errors import sanitize_error
from durable.dispatch.broker import Outgoing, direct_queue, publishers

# Executing a shipment is durable.dispatch.execution; its names stay importable from here.
from durable.dispatch.execution import (
    DONE,
    FAILED,
    RETRY,
    STALE,
    Resolvers,
    Shipment,
    _log,
    execute,
    record_failure,
)
from durable.storage import claims

#: The durable queue (and direct exchange, and routing key) shipments travel on.
QUEUE = "durable.executor"
#: Timer kinds an executor runs. Cron occurrences, workflow replays and Celery publishes
#: stay in the worker: they need its lease token or are a publish already.
SHIPPED_KINDS = frozenset({"handler", "task"})
#: Requeues of one message for an unreachable database before it is dropped (the claim's
#: expiry then runs the timer again).
MAX_REQUEUES = 10


def ship(shipment: Shipment, url: str) -> None:
    """Publish ``shipment`` persistently to :data:`QUEUE` (confirmed on RabbitMQ)."""
    message = Outgoing(body=shipment.to_json(), headers={"durable": "shipment/1"})
    publishers.publish(url, message, direct_queue(QUEUE))


class ExecutorConsumer:
    """Takes shipments off :data:`QUEUE` one at a time and executes them.

    A message is acknowledged once its completion committed (or it proved stale or
    malformed). An unreachable database requeues it (after a pause, at most
    ``MAX_REQUEUES`` times in a row); any other error is recorded as the attempt's
    failure on the row and the message rejected (not requeued), so no message loops.
    """

    def __init__(self, *, url: str, db: str, clock: Clock, resolvers: Resolvers) -> None:
        self.url = url
        self.db = db
        self.clock = clock
        self.resolvers = resolvers
        self.outcomes: dict[str, int] = {DONE: 0, RETRY: 0, FAILED: 0, STALE: 0}
        self.requeues: dict[int, int] = {}  # timer id -> requeues for a transient error

    def run(self, stop: threading.Event, *, poll_s: float = 1.0) -> None:
        """Consume until ``stop`` is set, reconnecting (with a pause) when the broker drops."""
        while not stop.is_set():
            try:
                self.drain(stop, poll_s=poll_s)
            except Exception as exc:  # broker gone: wait, reconnect
                _log(logging.WARNING, "executor.broker_error", error=sanitize_error(exc))
                stop.wait(min(5.0, poll_s * 2))

    def drain(
        self, stop: threading.Event | None = None, *, poll_s: float = 0.1, limit: int = 0
    ) -> int:
        """Handle messages until none arrives within ``poll_s`` (or ``stop``, or ``limit``)."""
        handled = 0
        with (
            Connection(self.url) as conn,
            conn.Consumer(
                [direct_queue(QUEUE)],
                callbacks=[self._on_message],
                accept=["json"],
                prefetch_count=1,
            ),
        ):
            while not (stop and stop.is_set()) and not (limit and handled >= limit):
                try:
                    conn.drain_events(timeout=poll_s)
                except TimeoutError:
                    if stop is None:
                        return handled
                    continue
                handled += 1
        return handled

    def _on_message(self, body: Any, message: Message) -> None:
        try:
            shipment = Shipment.from_json(body)
        except ValueError as exc:
            _log(logging.ERROR, "executor.bad_message", error=sanitize_error(exc))
            message.reject()  # never runnable: do not redeliver it forever
            return
        try:
            outcome = execute(shipment, db=self.db, clock=self.clock, resolvers=self.resolvers)
        except (OperationalError, InterfaceError) as exc:
            self._transient(shipment, message, exc)
            return
        except Exception as exc:  # e.g. a value the bookkeeping cannot store
            self._permanent(shipment, message, exc)
            return
        finally:
            close_old_connections()
        self.requeues.pop(shipment.timer_id, None)
        self.outcomes[outcome] += 1
        message.ack()

    def _transient(self, shipment: Shipment, message: Message, exc: Exception) -> None:
        """The database is unreachable: requeue after a pause, up to ``MAX_REQUEUES`` times.

        Past that the message is dropped: the timer's claim stands in the database, and the
        worker runs it again when the claim expires (never lost).
        """
        count = self.requeues.get(shipment.timer_id, 0) + 1
        self.requeues[shipment.timer_id] = count
        _log(logging.WARNING, "executor.database_error", timer=shipment.timer_id,
             requeues=count, error=sanitize_error(exc))  # fmt: skip
        if count > MAX_REQUEUES:
            self.requeues.pop(shipment.timer_id, None)
            message.reject()
            return
        time.sleep(min(5.0, 0.1 * 2**count))
        message.requeue()

    def _permanent(self, shipment: Shipment, message: Message, exc: Exception) -> None:
        """An error that another try would meet again (a value out of range, a missing
        table): the attempt fails on the row, and the message is done with. If recording
        the failure fails the same way, the timer is dead-lettered with the error."""
        _log(logging.ERROR, "executor.permanent_error", timer=shipment.timer_id,
             error=sanitize_error(exc))  # fmt: skip
        try:
            try:
                outcome = record_failure(self.db, self.clock, shipment, exc)
            except Exception:
                error = f"executing it failed outside its handler: {sanitize_error(exc)}"
                with transaction.atomic(using=self.db):
                    now_ms = self.clock.now_ms()
                    dead = claims.dead_letter(
                        self.db, shipment.timer_id, shipment.token, now_ms, error
                    )
                outcome = FAILED if dead else STALE
        except Exception as again:  # the database is gone too: the claim's expiry re-runs it
            _log(logging.ERROR, "executor.record_failed", timer=shipment.timer_id,
                 error=sanitize_error(again))  # fmt: skip
            message.reject()
            return
        finally:
            close_old_connections()
        self.outcomes[outcome] += 1
        message.reject()  # recorded on the row; never to be delivered again


class EmbeddedExecutor:
    """Executor threads inside the current process (needed for ``memory://``)."""

    def __init__(
        self, *, url: str, db: str, clock: Clock, resolvers: Resolvers, threads: int = 1
    ) -> None:
        self.stop_event = threading.Event()
        self.consumers = [
            ExecutorConsumer(url=url, db=db, clock=clock, resolvers=resolvers)
            for _ in range(threads)
        ]
        self.threads = [
            threading.Thread(
                target=consumer.run,
                args=(self.stop_event,),
                kwargs={"poll_s": 0.2},
                name=f"durable-executor-{i}",
                daemon=True,
            )
            for i, consumer in enumerate(self.consumers)
        ]

    def start(self) -> EmbeddedExecutor:
        """Start the threads (once; later calls do nothing); returns self."""
        for thread in self.threads:
            if thread.ident is None:
                thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the threads to finish their message and stop; wait for them."""
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout_s)
