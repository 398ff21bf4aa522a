"""pysyncobj's TCP transport, bound to one source address and logging refused peers.

Two changes to pysyncobj 0.3.17's ``TCPTransport`` (pinned, because this reaches into its
connection class):

* outgoing connections leave from the host this node listens on (``BIND``), so a proxy
  between nodes can tell them apart by source address, and a multi-homed host never
  sends Raft traffic out of an unexpected interface;
* every connection decrypts through :class:`RefusingEncryptor`, which logs
  ``raft.peer_refused`` when a message fails to decrypt (wrong password, or not
  pysyncobj at all) before pysyncobj drops the connection.

Why a message from a peer without the password never reaches pickle: pysyncobj's
``TcpConnection.__processParseMessage`` (tcp_connection.py, 0.3.17) calls the encryptor's
``extract_timestamp`` and ``decrypt`` on the raw frame *before* ``pickle.loads``, inside a
``try`` whose ``except`` disconnects. Fernet's ``decrypt`` checks the HMAC-SHA256 of the
frame first and raises ``InvalidToken`` on a mismatch; so with a password set, only a frame
made with the same password is ever unpickled. Hence the password is mandatory
(``durable.E022``): without one pysyncobj would unpickle anything a peer sends.
"""

from __future__ import annotations

import base64
import functools
import logging
import socket
import struct
import time
import types
import zlib
from typing import Any

from pysyncobj import pickle as syncobj_pickle
from pysyncobj.monotonic import monotonic as monotonic_time
from pysyncobj.poller import POLL_EVENT_TYPE
from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection, _getAddrType
from pysyncobj.transport import TCPTransport

from durable.worker.logs import event

log = logging.getLogger("durable.raft")

# One refusal log per peer address per this many seconds: a peer with a wrong password
# reconnects to every group over and over, and the log must not drown in it.
REFUSAL_LOG_EVERY_S = 10.0
_last_refusal: dict[str, float] = {}
refused_total = 0
"""Frames refused since start (all groups of this process); read by tests and status."""


class RefusingEncryptor:
    """Wraps pysyncobj's Fernet encryptor; logs a frame that fails to decrypt."""

    def __init__(self, inner: Any, peer: str, shard: int) -> None:
        self.inner = inner
        self.peer = peer
        self.shard = shard
        # pysyncobj calls extract_timestamp then decrypt on each frame, and Fernet checks
        # the frame's HMAC (and decodes its base64) in both: a fifth of the sidecar's
        # receive cost. The first call checks and decrypts; the second reuses it.
        self._checked: tuple[bytes, bytes] | None = None

    def encrypt_at_time(self, data: bytes, at: int) -> bytes:
        """Encrypt as pysyncobj does."""
        return bytes(self.inner.encrypt_at_time(data, at))

    def extract_timestamp(self, data: bytes) -> int:
        """The frame's timestamp; a frame that fails its HMAC check is refused here."""
        try:
            plain = bytes(self.inner.decrypt(data))  # checks the HMAC first
        except Exception as exc:
            self._refused(exc)
            raise
        self._checked = (data, plain)
        # A Fernet token is base64 of version (1 byte) | timestamp (8, big-endian) | ...:
        # its first 12 characters are those 9 bytes.
        return int.from_bytes(base64.urlsafe_b64decode(data[:12])[1:9], "big")

    def decrypt(self, data: bytes) -> bytes:
        """Decrypt (pysyncobj then unpickles only what this returns)."""
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] is data:
            return checked[1]
        try:
            return bytes(self.inner.decrypt(data))
        except Exception as exc:
            self._refused(exc)
            raise

    def _refused(self, exc: Exception) -> None:
        global refused_total
        refused_total += 1
        now = time.monotonic()
        host = self.peer.rpartition(":")[0] or self.peer
        if now - _last_refusal.get(host, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
            _last_refusal[host] = now
            event(
                log,
                logging.WARNING,
                "raft.peer_refused",
                peer=self.peer,
                shard=self.shard,
                reason=type(exc).__name__,
                refused_total=refused_total,
            )


STORED_BLOCK = 65_535
"""Most bytes one stored (uncompressed) deflate block carries."""


def _zlib_stored(data: bytes) -> bytes:
    """``data`` as a zlib stream of stored blocks: valid for ``zlib.decompress``, not
    compressed.

    pysyncobj's receiver always runs ``zlib.decompress``, so a frame must be a zlib stream,
    but nothing needs it small: the links are a cluster's own network, and most frames are
    heartbeats and their answers of about 100 bytes. Compressing was the costliest step of
    the sidecar: ``zlib.compress(data, 3)`` set up a 256 KB window per frame (about 0.8 ms a
    frame on a loaded machine), and a 512-byte window at level 1 still cost 3.1 us a frame
    and a fifth of the sidecar's time at 2,000 fires/s (py-spy). This costs 0.4 us a
    heartbeat, 11 us for a 40 KB batch (167 us at level 1). Header, blocks (final bit,
    length, its complement), then the Adler-32 of the data (RFC 1950 and 1951).
    """
    out = [b"\x78\x01"]
    for start in range(0, max(len(data), 1), STORED_BLOCK):
        block = data[start : start + STORED_BLOCK]
        final = 1 if start + STORED_BLOCK >= len(data) else 0
        out.append(struct.pack("<BHH", final, len(block), len(block) ^ 0xFFFF))
        out.append(block)
    out.append(struct.pack(">I", zlib.adler32(data)))
    return b"".join(out)


def light_send(self: Any, message: Any) -> None:
    """pysyncobj's ``TcpConnection.send`` without the compression (:func:`_zlib_stored`).

    Same format on the wire: the receiver's ``zlib.decompress`` reads stored blocks as it
    reads compressed ones, so nodes with and without this agree.
    """
    if isinstance(message, dict) and message.get("type") == "request_vote":
        # Sent on a link that may have carried nothing for a long time (see
        # :func:`read_first`): the idle check on send must not drop it.
        self._TcpConnection__lastReadTime = monotonic_time()
    if self.sendRandKey:
        message = (self.sendRandKey, message)
    data = _zlib_stored(syncobj_pickle.dumps(message))
    if self.encryptor:
        data = self.encryptor.encrypt_at_time(data, int(monotonic_time()))
    self._TcpConnection__writeBuffer += struct.pack("i", len(data)) + data
    self._TcpConnection__trySendBuffer()


def read_first(self: Any, descr: int, event_type: int) -> None:
    """pysyncobj's ``TcpConnection.__processConnection``, but a link with data to read is
    not dropped as idle.

    pysyncobj drops a connection when it has read nothing on it for ``connectionTimeout``,
    and checks that on every send and at every poll event *before* it reads. Two
    followers send each other nothing while their leader lives, so when the leader died,
    the candidate's vote request (the first frame on that link in a long while) was
    dropped on send, or on arrival by the other follower, whose check ran before the read.
    The other follower then stood too, the vote split, and every group needed a second
    round: a new leader 1.4-1.9 s after a SIGKILL instead of 0.8-1.0 s (issue 17's 2 s
    failover target). A readable socket is a live peer (or its close, which the read
    finds), so its time of last read is now before the check. A peer that sends nothing
    is still dropped as before, on the next send to it.
    """
    if event_type & POLL_EVENT_TYPE.READ:
        self._TcpConnection__lastReadTime = monotonic_time()
    TcpConnection._TcpConnection__processConnection(self, descr, event_type)


class SourceBoundConnection(TcpConnection):  # type: ignore[misc]
    """A ``TcpConnection`` whose outgoing socket is bound to ``source_host`` first."""

    source_host: str | None = None
    send = light_send
    _TcpConnection__processConnection = read_first

    def connect(self, host: str, port: int) -> bool:
        """pysyncobj's ``connect`` with one added ``bind((source_host, 0))``."""
        if host is None:
            return False
        self._TcpConnection__state = CONNECTION_STATE.DISCONNECTED
        self._TcpConnection__fileno = None
        sock = socket.socket(_getAddrType(host), socket.SOCK_STREAM)
        self._TcpConnection__socket = sock
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._TcpConnection__sendBufferSize)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._TcpConnection__recvBufferSize)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.setSockoptKeepalive()
        if self.source_host:
            sock.bind((self.source_host, 0))
        sock.setblocking(False)
        self._TcpConnection__readBuffer = b""
        self._TcpConnection__writeBuffer = b""
        self._TcpConnection__lastReadTime = monotonic_time()
        try:
            sock.connect((host, port))
        except OSError as e:
            if e.errno not in (socket.errno.EINPROGRESS, socket.errno.EWOULDBLOCK):  # type: ignore[attr-defined]
                return False
        self._TcpConnection__fileno = sock.fileno()
        self._TcpConnection__state = CONNECTION_STATE.CONNECTING
        self._TcpConnection__poller.subscribe(
            self._TcpConnection__fileno,
            self._TcpConnection__processConnection,
            POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR,
        )
        return True


def transport_class(source_host: str, shard: int) -> type[TCPTransport]:
    """A ``TCPTransport`` subclass for shard ``shard``'s group (see the module docstring)."""

    class DurableTransport(TCPTransport):  # type: ignore[misc]
        def addNode(self, node: Any) -> None:
            # pysyncobj's addNode, with our connection class and a logging encryptor.
            self._nodes.add(node)
            self._nodeAddrToNode[node.address] = node
            if self._shouldConnect(node):
                conf = self._syncObj.conf
                conn = SourceBoundConnection(
                    poller=self._syncObj._poller,
                    timeout=conf.connectionTimeout,
                    sendBufferSize=conf.sendBufferSize,
                    recvBufferSize=conf.recvBufferSize,
                    keepalive=conf.tcp_keepalive,
                )
                conn.source_host = source_host
                conn.encryptor = RefusingEncryptor(self._syncObj.encryptor, node.address, shard)
                conn.setOnConnectedCallback(functools.partial(self._onOutgoingConnected, conn))
                conn.setOnMessageReceivedCallback(functools.partial(self._onMessageReceived, node))
                conn.setOnDisconnectedCallback(functools.partial(self._onDisconnected, conn))
                self._connections[node] = conn

        def _onNewIncomingConnection(self, conn: Any) -> None:
            super()._onNewIncomingConnection(conn)
            try:
                host, port = conn._TcpConnection__socket.getpeername()[:2]
                peer = f"{host}:{port}"
            except OSError:
                peer = "?"
            conn.encryptor = RefusingEncryptor(self._syncObj.encryptor, peer, shard)
            conn.send = types.MethodType(light_send, conn)  # pysyncobj built this one
            # pysyncobj subscribed its own method when it built the connection; its later
            # subscriptions look the name up on the instance, and so find this one.
            conn._TcpConnection__processConnection = types.MethodType(read_first, conn)
            if conn.fileno() is not None:
                conn._TcpConnection__poller.subscribe(
                    conn.fileno(),
                    conn._TcpConnection__processConnection,
                    POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR,
                )

    return DurableTransport
