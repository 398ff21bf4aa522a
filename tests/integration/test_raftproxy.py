"""The Raft test proxy alone, with echo servers standing in for three nodes.

Each "node" i listens on 127.0.0.(10+i) (its bind address, two ports) and its clients
connect from that IP, as Raft nodes do; the proxy listens on 127.0.0.1 (the advertised
ranges). Checked: bytes go through and come back, a cut closes a node's live links in
both directions (as target and as source) and refuses new ones, restore lets them
through again, and a delay delays.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from durable.testing.raftproxy import ProxiedNode, RaftProxy, free_port_base

PORTS = 2
NAMES = ("n1", "n2", "n3")
#: Client sockets of the running test, closed by the ``proxy`` fixture.
_CLIENTS: list[socket.socket] = []


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def proxy() -> Iterator[RaftProxy]:
    servers = []
    nodes = []
    listen_base = free_port_base("127.0.0.1", PORTS * len(NAMES))
    for i, name in enumerate(NAMES, start=1):
        host = f"127.0.0.{10 + i}"
        bind_base = free_port_base(host, PORTS)
        for offset in range(PORTS):
            server = _Server((host, bind_base + offset), _Echo)
            threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
            servers.append(server)
        nodes.append(ProxiedNode(name, "127.0.0.1", listen_base + PORTS * (i - 1), host, bind_base))
    try:
        with RaftProxy(nodes, ports=PORTS) as running:
            yield running
    finally:
        for sock in _CLIENTS:
            sock.close()
        _CLIENTS.clear()
        for server in servers:
            server.shutdown()
            server.server_close()


def connect(proxy: RaftProxy, source: str, target: str, offset: int = 0) -> socket.socket:
    """A connection from node ``source``'s IP to node ``target``'s advertised port."""
    node = proxy.nodes[target]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    _CLIENTS.append(sock)
    sock.settimeout(5)
    sock.bind((proxy.nodes[source].bind_host, 0))
    sock.connect((node.listen_host, node.listen_base + offset))
    return sock


def echoes(sock: socket.socket, payload: bytes = b"ping") -> bool:
    """True if ``payload`` comes back; False if the link is closed."""
    try:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = sock.recv(65536)
            if not chunk:
                return False
            got += chunk
        return got == payload
    except (ConnectionError, OSError):
        return False


def wait_links(proxy: RaftProxy, n: int) -> list[tuple[str | None, str, int]]:
    deadline = time.monotonic() + 5
    while len(links := proxy.links()) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return links


def test_forwards_to_the_bind_address_and_names_both_ends(proxy):
    a = connect(proxy, "n1", "n2", offset=1)
    b = connect(proxy, "n3", "n1")
    big = bytes(range(256)) * 4096  # 1 MB: several chunks each way
    assert echoes(a) and echoes(b) and echoes(a, big)
    n1, n2 = proxy.nodes["n1"], proxy.nodes["n2"]
    assert wait_links(proxy, 2) == [("n1", "n2", n2.bind_base + 1), ("n3", "n1", n1.bind_base)]
    assert proxy.accepted == 2 and proxy.refused == 0
    a.close()
    b.close()
    assert wait_links(proxy, 0) == []


def test_cut_closes_a_nodes_links_both_ways_and_refuses_new_ones(proxy):
    into = connect(proxy, "n1", "n2")  # n2 as target
    out_of = connect(proxy, "n2", "n3")  # n2 as source
    other = connect(proxy, "n1", "n3")
    assert echoes(into) and echoes(out_of) and echoes(other)

    assert proxy.cut("n2") == 2
    assert not echoes(into)
    assert not echoes(out_of)
    assert echoes(other), "a link between two other nodes is left alone"
    assert wait_links(proxy, 1) == [("n1", "n3", proxy.nodes["n3"].bind_base)]
    for source, target in (("n1", "n2"), ("n2", "n3"), ("n3", "n2")):
        assert not echoes(connect(proxy, source, target)), f"{source}->{target} got through"
    assert proxy.refused == 3

    proxy.restore("n2")
    for source, target in (("n1", "n2"), ("n2", "n3"), ("n3", "n2")):
        assert echoes(connect(proxy, source, target)), f"{source}->{target} still cut"


def test_an_unknown_source_is_cut_by_its_target_only(proxy):
    anon = socket.create_connection(
        (proxy.nodes["n1"].listen_host, proxy.nodes["n1"].listen_base), timeout=5
    )
    _CLIENTS.append(anon)
    assert echoes(anon)
    assert proxy.links()[0][0] is None
    proxy.cut("n2")
    assert echoes(anon)
    proxy.cut("n1")
    assert not echoes(anon)


def test_delay_applies_each_way_and_can_be_removed(proxy):
    sock = connect(proxy, "n1", "n2")
    assert echoes(sock)
    proxy.delay("n2", 0.2)
    started = time.monotonic()
    assert echoes(sock)
    round_trip = time.monotonic() - started
    assert 0.4 <= round_trip < 2.0, round_trip  # 0.2 s there and 0.2 s back
    proxy.delay("n1", 0.1)  # both ends delayed: the delays add up
    started = time.monotonic()
    assert echoes(sock)
    assert 0.6 <= time.monotonic() - started < 2.5
    proxy.delay("n1", 0)
    proxy.delay("n2", 0)
    started = time.monotonic()
    assert echoes(sock)
    assert time.monotonic() - started < 0.2


def test_bad_control_calls_name_the_problem(proxy):
    with pytest.raises(ValueError, match="no node 'n9'"):
        proxy.cut("n9")
    with pytest.raises(ValueError, match="delay must be >= 0"):
        proxy.delay("n1", -1)
    node = proxy.nodes["n1"]
    with pytest.raises(ValueError, match="own bind host"):
        RaftProxy([node, ProxiedNode("x", "127.0.0.1", 1, node.bind_host, 2)], ports=1)
    with pytest.raises(RuntimeError, match="not running"):
        RaftProxy([node], ports=1).cut("n1")
