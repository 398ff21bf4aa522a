"""Publishing to a kombu broker: one connection per thread and URL, confirms where possible.

Both the Celery publish (:mod:`durable.dispatch.celery`) and ``DISPATCH = "kombu"``
(:mod:`durable.dispatch.executors`) send through :data:`publishers`. A publish runs on
one of the worker's executor threads; kombu connections and channels are not
thread-safe, so each thread keeps its own connection (and producer) per broker URL and
reuses it for every publish, instead of paying a TCP and AMQP handshake per message.

Nothing here retries for long: a publish that fails raises, and the timer that asked
for it is retried with its own backoff (DESIGN §6), so a broker outage delays messages
and loses none. The one exception is a pooled connection that went stale (the broker
restarted since the last publish): that publish is tried once more on a new connection.

Inside :meth:`PublisherPool.deferred` a thread's publishes are buffered and sent
together when the block ends: on Redis (kombu >= 5.7, ``Producer.batch``) that is one
pipelined round trip for a whole firing batch instead of one per message, which is what
limited a worker to about a thousand Celery publishes a second. Transports without
batch support (RabbitMQ, which confirms each message) publish at once as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any
from urllib.parse import urlsplit

from kombu import Connection, Exchange, Producer, Queue

#: Schemes of transports built on py-amqp (RabbitMQ), which support publisher confirms.
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp"})
# Short: a Celery publish runs inside the worker's batch transaction, which holds the
# shard's lease row; a broker that hangs must fail the publish well within the lease TTL.
CONNECT_TIMEOUT_S = 2.0
CONFIRM_TIMEOUT_S = 3.0
#: Buffered broker commands after which a deferred batch flushes early (kombu's unit).
DEFERRED_MAX_COMMANDS = 1000


class DeferredPublishError(Exception):
    """The flush of a :meth:`PublisherPool.deferred` block failed.

    Some of its messages may have reached the broker (a pipeline is not a transaction):
    the caller must treat all of them as not sent, and send them again (at least once).
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """One message to publish: JSON body, headers and AMQP properties."""

    body: Any
    headers: dict[str, Any] = field(default_factory=dict)
    properties: dict[str, Any] = field(default_factory=dict)


@cache  # kombu entities cost ~50 us to build; a publish path builds one per message
def direct_queue(name: str) -> Queue:
    """The durable queue ``name`` bound to the direct exchange ``name`` by key ``name``.

    That is how Celery declares its default queue (``celery``) and any queue it
    creates on demand (``task_create_missing_queues``), so a stock worker started with
    ``-Q name`` consumes what lands here. Declaring it before publishing matters: on
    RabbitMQ, a message routed to no queue is dropped.
    """
    return Queue(name, Exchange(name, type="direct", durable=True), routing_key=name, durable=True)


def transport_options(url: str) -> dict[str, Any]:
    """Transport options for ``url``: publisher confirms on RabbitMQ."""
    scheme = urlsplit(url).scheme.split("+", 1)[0]
    return {"confirm_publish": True} if scheme in AMQP_SCHEMES else {}


class _Slot:
    """A thread's connection and producer for one broker URL."""

    def __init__(self, url: str, connect_timeout_s: float) -> None:
        self.connection = Connection(
            url, transport_options=transport_options(url), connect_timeout=connect_timeout_s
        )
        try:
            # No retry here (kombu's default waits 2 s and tries again): the timer's
            # backoff is the retry, and an executor thread is not held up meanwhile.
            self.connection.ensure_connection(max_retries=0)
            self.producer = Producer(self.connection.default_channel)
        except BaseException:
            self.close()
            raise
        self.used = False  # a connection that never published cannot be "stale"

    def close(self) -> None:
        """Release the connection (its channel and producer go with it)."""
        # A dead connection may refuse to close cleanly; it is being dropped anyway.
        with contextlib.suppress(Exception):
            self.connection.release()


class _Deferral:
    """The open batches and the after-send callbacks of one :meth:`PublisherPool.deferred`."""

    def __init__(self) -> None:
        self.batches: dict[str, Any] = {}  # url -> entered kombu batch context
        self.after: list[Callable[[], None]] = []
        self.broken = False  # a publish failed inside the block: its batch is gone


class PublisherPool:
    """Per-thread kombu connections and producers, keyed by broker URL."""

    def __init__(self, *, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._local = threading.local()

    def publish(
        self,
        url: str,
        message: Outgoing,
        queue: Queue,
        *,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        """Publish ``message`` persistently to ``queue`` (declared first) on ``url``.

        Sent through the default exchange, which routes by queue name: the message lands
        in ``queue`` whatever other bindings it has, and on Redis this saves the lookup
        of the exchange's bindings that kombu makes per publish (twice the rate). Returns
        once the broker confirmed it (RabbitMQ) or took it (other transports); raises the
        transport's error otherwise. Inside :meth:`deferred`, on a transport that can
        batch, it returns with the message only held: the block's end sends it.
        ``on_sent`` runs once the broker has the message: before this returns, or after
        the deferred block's flush (never, if the flush failed).
        """
        deferral: _Deferral | None = getattr(self._local, "deferral", None)
        for attempt in (1, 2):
            stale_possible = held = False
            try:
                slot = self._slot(url)
                stale_possible = slot.used and deferral is None
                # Producer.batch is kombu >= 5.7; older releases publish at once.
                batching = getattr(slot.producer, "supports_batch_publish", False)
                if deferral is not None and batching:
                    if url not in deferral.batches:
                        batch = slot.producer.batch(max_size=DEFERRED_MAX_COMMANDS)
                        batch.__enter__()
                        deferral.batches[url] = batch
                    held = True
                slot.producer.publish(
                    message.body,
                    exchange="",
                    routing_key=queue.name,
                    declare=[queue],
                    serializer="json",
                    headers=message.headers,
                    delivery_mode=2,
                    retry=False,
                    confirm_timeout=CONFIRM_TIMEOUT_S,
                    **message.properties,
                )
            except Exception:
                self._abandon(url, deferral)
                if attempt == 2 or not stale_possible:
                    raise
                continue
            slot.used = True
            if on_sent is not None:
                if held and deferral is not None:
                    deferral.after.append(on_sent)
                else:
                    on_sent()
            return

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Buffer this thread's publishes during the block; send them all at its end.

        Publishes that kombu can batch on their transport are held and flushed together
        when the block ends without an exception (and early, every
        :data:`DEFERRED_MAX_COMMANDS` commands); a block that raises discards what was
        held. Other transports publish at once, as outside the block. A failed flush
        raises :class:`DeferredPublishError`, and a publish that raised inside the block
        fails it too, even if the caller swallowed the error. Blocks do not nest: an
        inner one joins the outer.
        """
        if getattr(self._local, "deferral", None) is not None:
            yield
            return
        deferral = self._local.deferral = _Deferral()
        try:
            yield
        except BaseException as exc:
            for url, batch in deferral.batches.items():
                with contextlib.suppress(Exception):
                    batch.__exit__(type(exc), exc, exc.__traceback__)
                self.discard(url)
            raise
        finally:
            self._local.deferral = None
        failed: Exception | None = None
        if deferral.broken:  # the caller swallowed a publish error: what it held is lost
            failed = RuntimeError("a publish failed inside the block")
        for url, batch in deferral.batches.items():
            if failed is not None:  # one flush failed: drop the rest too
                with contextlib.suppress(Exception):
                    batch.__exit__(DeferredPublishError, None, None)
                self.discard(url)
                continue
            try:
                batch.__exit__(None, None, None)
            except Exception as exc:
                failed = exc
                self.discard(url)
            else:
                self._slot(url).used = True
        if failed is not None:
            raise DeferredPublishError(f"deferred publish failed: {failed}") from failed
        for callback in deferral.after:
            callback()

    def _abandon(self, url: str, deferral: _Deferral | None) -> None:
        """Drop ``url``'s connection after an error (and its batch, if deferring)."""
        if deferral is not None:
            deferral.broken = True
            batch = deferral.batches.pop(url, None)
            if batch is not None:
                with contextlib.suppress(Exception):
                    batch.__exit__(DeferredPublishError, None, None)
        self.discard(url)

    def _slot(self, url: str) -> _Slot:
        slots: dict[str, _Slot] = self._slots()
        slot = slots.get(url)
        if slot is None:
            slot = slots[url] = _Slot(url, self.connect_timeout_s)
        return slot

    def _slots(self) -> dict[str, _Slot]:
        slots = getattr(self._local, "slots", None)
        if slots is None:
            slots = self._local.slots = {}
        return slots

    def discard(self, url: str) -> None:
        """Close and forget this thread's connection to ``url`` (the next publish reconnects)."""
        slot = self._slots().pop(url, None)
        if slot is not None:
            slot.close()

    def close(self, urls: Sequence[str] | None = None) -> None:
        """Close this thread's connections (all of them, or those to ``urls``)."""
        for url in list(urls if urls is not None else self._slots()):
            self.discard(url)


#: The process's pool. A module-level object because the timer-kind resolver API
#: (``resolver(target) -> HandlerSpec``) hands the firer no engine to hang it on; it
#: holds only per-thread connections, which die with their threads.
publishers = PublisherPool()
