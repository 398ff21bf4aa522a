"""A TCP proxy a test controls, between Raft nodes: cut a node off, restore it, slow it down.

Raft nodes (``run_timer_shards`` with ``DURABLE["RAFT"]``) advertise one address to their
peers (``SELF``) and listen on another (``BIND``); shard ``s``'s group uses base port + s
of each. :class:`RaftProxy` listens on every node's advertised range and forwards each
connection to the node's bind address, so every Raft link goes through it. Each node
listens on (and connects from) its own loopback IP, ``127.0.0.(10+i)``: the proxy tells
which node opened a connection by its source IP (pysyncobj opens one connection per pair
of nodes, from the node with the larger address, and both directions share it).

:meth:`RaftProxy.cut` closes every live link of a node, both directions, and refuses its
new ones until :meth:`RaftProxy.restore`; :meth:`RaftProxy.delay` adds a delay to every
byte a node's links carry. The node's database connections do not go through the proxy:
a cut node is partitioned from its Raft peers, not from PostgreSQL.

The proxy runs an asyncio loop in a daemon thread of the test process; every control
call returns once it has taken effect (a cut node's links are closed when ``cut``
returns).

>>> nodes = [ProxiedNode(f"n{i}", "127.0.0.1", 27100 + 100 * i, f"127.0.0.{10 + i}", 7100)
...          for i in (1, 2, 3)]                                  # doctest: +SKIP
>>> with RaftProxy(nodes, ports=64) as proxy:                     # doctest: +SKIP
...     proxy.cut("n1"); ...; proxy.restore("n1")
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import socket
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

__all__ = ["Link", "ProxiedNode", "RaftProxy", "free_port_base", "loopback_nodes"]

T = TypeVar("T")
CHUNK = 65536
#: Seconds a control call waits for the proxy's loop before giving up.
CONTROL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ProxiedNode:
    """One node behind the proxy.

    Its peers reach it at ``listen_host:listen_base + s`` (its advertised ``SELF``); the
    proxy forwards to ``bind_host:bind_base + s`` (its ``BIND``). Its own outgoing
    connections come from ``bind_host``, which is how the proxy recognises them.
    """

    name: str
    listen_host: str
    listen_base: int
    bind_host: str
    bind_base: int

    @property
    def advertised(self) -> str:
        """``host:port`` of its first group as its peers see it (``--raft-self``)."""
        return f"{self.listen_host}:{self.listen_base}"

    @property
    def bind(self) -> str:
        """``host:port`` it listens on (``--raft-bind``)."""
        return f"{self.bind_host}:{self.bind_base}"


@dataclass(eq=False)
class Link:
    """One proxied connection: from a node (``None``: an address no node binds) to a node."""

    source: str | None
    target: str
    port: int
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    sent: int = 0

    def touches(self, name: str) -> bool:
        """True when ``name`` is either end."""
        return name in (self.source, self.target)

    def abort(self) -> None:
        """Close both sockets at once (RST, no lingering)."""
        for writer in self.writers:
            writer.transport.abort()


def free_port_base(host: str, count: int, *, low: int = 20_000, high: int = 32_000) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` can all be bound on ``host`` now.

    The default range stays below Linux's ephemeral ports (32768 up), so an outgoing
    connection cannot take one of them between this call and the listener's bind.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host} between {low} and {high}")


def loopback_nodes(count: int, ports: int, prefix: str = "n") -> list[ProxiedNode]:
    """``count`` nodes named ``n1..``: node i binds ``127.0.0.(10+i)``, advertised on 127.0.0.1.

    Every range is free when this returns (``ports`` ports each), on free ports.
    """
    listen_base = free_port_base("127.0.0.1", count * ports)
    nodes = []
    for i in range(1, count + 1):
        host = f"127.0.0.{10 + i}"
        nodes.append(
            ProxiedNode(
                f"{prefix}{i}",
                "127.0.0.1",
                listen_base + (i - 1) * ports,
                host,
                free_port_base(host, ports),
            )
        )
    return nodes


class RaftProxy:
    """Forwards every node's ``ports`` advertised ports to its bind ports; cut, restore, delay."""

    def __init__(self, nodes: Sequence[ProxiedNode], ports: int) -> None:
        if ports < 1:
            raise ValueError(f"RaftProxy needs at least one port per node, got ports={ports}")
        names = [node.name for node in nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"RaftProxy node names must be distinct, got {names}")
        sources = [node.bind_host for node in nodes]
        if len(set(sources)) != len(sources):
            raise ValueError(
                f"each node needs its own bind host (the proxy tells nodes apart by source IP),"
                f" got {sources}"
            )
        self.nodes = {node.name: node for node in nodes}
        self.ports = ports
        self._by_source = {node.bind_host: node.name for node in nodes}
        self._cut: set[str] = set()
        self._delay: dict[str, float] = {}
        self._links: set[Link] = set()
        self._servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.refused = 0
        self.accepted = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> RaftProxy:
        """Open every listener (all bound when this returns)."""
        if self._loop is not None:
            raise RuntimeError("RaftProxy already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="raft-proxy", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._open())
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Close every listener and link and stop the loop's thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=CONTROL_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> RaftProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- control ----------------------------------------------------------------------

    def cut(self, name: str) -> int:
        """Partition ``name`` from every peer: close its live links, refuse new ones.

        Returns how many live links were closed.
        """
        self._node(name)
        return self._call(self._do_cut(name))

    def restore(self, name: str) -> None:
        """Let ``name``'s links through again (its nodes reconnect by themselves)."""
        self._node(name)
        self._call(self._set(lambda: self._cut.discard(name)))

    def delay(self, name: str, seconds: float) -> None:
        """Delay every byte ``name``'s links carry by ``seconds`` (0 removes the delay).

        A link between two delayed nodes carries the sum of both delays.
        """
        self._node(name)
        if seconds < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {seconds}")
        self._call(self._set(lambda: self._delay.__setitem__(name, float(seconds))))

    def links(self) -> list[tuple[str | None, str, int]]:
        """The live links as ``(source node, target node, target port)``."""

        async def snapshot() -> list[tuple[str | None, str, int]]:
            return sorted(
                ((link.source, link.target, link.port) for link in self._links),
                key=lambda t: (str(t[0]), t[1], t[2]),
            )

        return self._call(snapshot())

    # --- the loop's side --------------------------------------------------------------

    def _node(self, name: str) -> ProxiedNode:
        try:
            return self.nodes[name]
        except KeyError:
            known = sorted(self.nodes)
            raise ValueError(f"no node {name!r} behind this proxy (have {known})") from None

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("RaftProxy is not running: call start() first")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=CONTROL_TIMEOUT_S)

    async def _set(self, change: Callable[[], object]) -> None:
        change()

    async def _open(self) -> None:
        for node in self.nodes.values():
            for offset in range(self.ports):
                server = await asyncio.start_server(
                    functools.partial(self._serve, node, offset),
                    node.listen_host,
                    node.listen_base + offset,
                    reuse_address=True,
                )
                self._servers.append(server)

    async def _shutdown(self) -> None:
        for server in self._servers:
            server.close()
        for link in list(self._links):
            link.abort()
        self._links.clear()
        # Every connection's task ends here, not when the loop is garbage-collected.
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()

    async def _do_cut(self, name: str) -> int:
        self._cut.add(name)
        doomed = [link for link in self._links if link.touches(name)]
        for link in doomed:
            link.abort()
            self._links.discard(link)
        return len(doomed)

    def _blocked(self, source: str | None, target: str) -> bool:
        return target in self._cut or (source is not None and source in self._cut)

    def _link_delay(self, link: Link) -> float:
        ends = {link.target, *([link.source] if link.source else [])}
        return sum(self._delay.get(name, 0.0) for name in ends)

    async def _serve(
        self,
        node: ProxiedNode,
        offset: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        peer = writer.get_extra_info("peername")
        source = self._by_source.get(peer[0]) if peer else None
        if self._blocked(source, node.name):
            self.refused += 1
            writer.transport.abort()
            return
        port = node.bind_base + offset
        try:
            up_reader, up_writer = await asyncio.open_connection(node.bind_host, port)
        except OSError:  # the node is down (killed, restarting): the peer will retry
            writer.transport.abort()
            return
        link = Link(source, node.name, port, [writer, up_writer])
        if self._blocked(source, node.name):  # cut while we were connecting
            self.refused += 1
            link.abort()
            return
        self.accepted += 1
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pump(link, reader, up_writer), self._pump(link, up_reader, writer)
            )
        finally:
            link.abort()
            self._links.discard(link)

    async def _pump(
        self, link: Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Copy one direction; with a delay, each chunk leaves ``delay`` after it arrived."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                link.sent += len(data)
            # The other side closed its half: pass the close on (pysyncobj then reconnects).
            link.abort()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                try:
                    data = await reader.read(CHUNK)
                except (ConnectionError, OSError):
                    data = b""
                queue.put_nowait((loop.time() + self._link_delay(link), data))
                if not data:
                    break
            await sender
        except (ConnectionError, OSError):
            pass
        finally:
            if not sender.done():
                sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
