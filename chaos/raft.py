"""The chaos run with Raft on (``--raft``, ``make chaos RAFT=1``): nodes behind a proxy.

Each worker runs with ``DURABLE["RAFT"]`` (the test project reads it as JSON from
``DURABLE_RAFT``), listens on its own loopback IP (``127.0.0.(10+i)``) and advertises an
address on the run's proxy (:class:`durable.testing.raftproxy.RaftProxy`), so every Raft
link goes through the proxy and the nemesis can cut a node off (``partition``) or slow
its links down (``delay``); its database sessions do not go through the proxy. Ports
come from ``PORTS`` (this run's range on a shared machine), one per shard and node.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from durable.testing.raftproxy import ProxiedNode, RaftProxy, free_port_base

#: The ports the run's proxy and Raft nodes may use (low, high).
PORTS = (28_000, 29_000)
PASSWORD = "chaos-raft-password"  # a run on loopback only, nodes of its own


@dataclass
class RaftSetup:
    """The run's Raft nodes and proxy: what each worker starts with."""

    nodes: list[ProxiedNode]
    proxy: RaftProxy

    def env(self) -> dict[str, str]:
        """The workers' environment: ``DURABLE["RAFT"]`` as JSON."""
        advertised = [node.advertised for node in self.nodes]
        raft = {"SELF": advertised[0], "PEERS": advertised[1:], "PASSWORD": PASSWORD}
        return {"DURABLE_RAFT": json.dumps(raft)}

    def args(self, name: str) -> list[str]:
        """``run_timer_shards`` options of worker ``name``: its advertised and bind address."""
        node = next(n for n in self.nodes if n.name == name)
        return ["--raft-self", node.advertised, "--raft-bind", node.bind]

    def close(self) -> None:
        """Stop the proxy (after the workers)."""
        self.proxy.close()


def start(names: list[str], shards: int) -> RaftSetup:
    """Nodes named ``names`` (worker i on ``127.0.0.(10+i)``) and their running proxy."""
    low, high = PORTS
    listen = free_port_base("127.0.0.1", len(names) * shards, low=low, high=high)
    nodes = []
    for i, name in enumerate(names, start=1):
        host = f"127.0.0.{10 + i}"
        bind = free_port_base(host, shards, low=low, high=high)
        nodes.append(ProxiedNode(name, "127.0.0.1", listen + (i - 1) * shards, host, bind))
    return RaftSetup(nodes=nodes, proxy=RaftProxy(nodes, ports=shards).start())


def fault_window(rng: Any, kind: str) -> tuple[float, float]:
    """(seconds it lasts, link delay in seconds) of a ``partition`` or ``delay`` fault."""
    if kind == "partition":
        return rng.uniform(1, 10), 0.0
    return rng.uniform(2, 10), rng.uniform(0.05, 0.5)
