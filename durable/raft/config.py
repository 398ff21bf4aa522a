"""``DURABLE["RAFT"]`` parsed and checked (no pysyncobj needed to read it).

Every node names itself (``SELF``) and the others (``PEERS``) by a *base* address; shard
``s``'s Raft group listens on base port + ``s``. ``BIND`` is where this node listens (default
``SELF``): a node behind a proxy advertises the proxy's address as ``SELF`` and binds
elsewhere; its outgoing connections also leave from ``BIND``'s host, so the proxy can tell
nodes apart by source address. ``run_timer_shards --raft-self/--raft-bind`` override
``SELF``/``BIND`` for one process; the peers are then ``PEERS`` plus ``SELF`` minus the
effective self, so every node of a cluster can share one settings module.

:func:`problems` reports every problem (``manage.py check``); :func:`parse` returns a
:class:`RaftConfig` or raises :class:`RaftConfigError` naming them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KEYS = (
    "SELF",
    "PEERS",
    "PASSWORD",
    "BIND",
    "TICK_S",
    "HEARTBEAT_S",
    "ELECTION_TIMEOUT_S",
    "BALANCE_S",
)
"""Every key ``DURABLE["RAFT"]`` accepts."""

DEFAULT_TICK_S = 0.05
DEFAULT_HEARTBEAT_S = 0.1
DEFAULT_ELECTION_TIMEOUT_S = (0.6, 1.2)
DEFAULT_BALANCE_S = 10.0


class RaftConfigError(ValueError):
    """``DURABLE["RAFT"]`` cannot be used; the message names every problem."""


@dataclass(frozen=True, slots=True)
class RaftConfig:
    """One node's view of the Raft settings, with overrides applied."""

    self_addr: str
    bind: str
    peers: tuple[str, ...]
    password: str
    tick_s: float = DEFAULT_TICK_S
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    election_min_s: float = DEFAULT_ELECTION_TIMEOUT_S[0]
    election_max_s: float = DEFAULT_ELECTION_TIMEOUT_S[1]
    balance_s: float = DEFAULT_BALANCE_S

    def group_address(self, base: str, shard: int) -> str:
        """The address of shard ``shard``'s group on the node whose base is ``base``."""
        host, port = split_address(base)
        return f"{host}:{port + shard}"

    @property
    def bind_host(self) -> str:
        """The host this node listens on and connects from."""
        return split_address(self.bind)[0]


def split_address(text: str) -> tuple[str, int]:
    """``"host:port"`` → ``(host, port)``; raises ``ValueError`` saying what is wrong."""
    if not isinstance(text, str) or ":" not in text:
        raise ValueError(f"{text!r} is not 'host:port'")
    host, _, port_text = text.rpartition(":")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"{text!r} has no usable host")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r} has no port from 1 to 65535")
    return host, int(port_text)


def _number(raw: Mapping[str, Any], key: str, default: float, out: list[tuple[str, str]]) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 60:
        out.append(("durable.E021", f"DURABLE['RAFT'][{key!r}] must be a number in (0, 60]"))
        return default
    return float(value)


def problems(
    raw: Any, shards: int, self_override: str | None = None, bind_override: str | None = None
) -> list[tuple[str, str]]:
    """Every problem of ``raw`` as ``(check id, message)``; [] when it is usable."""
    return _parse(raw, shards, self_override, bind_override)[1]


def parse(
    raw: Any, shards: int, self_override: str | None = None, bind_override: str | None = None
) -> RaftConfig | None:
    """``raw`` as a :class:`RaftConfig` (None when Raft is off); raises
    :class:`RaftConfigError` naming every problem."""
    config, found = _parse(raw, shards, self_override, bind_override)
    if found:
        raise RaftConfigError(
            "DURABLE['RAFT'] is invalid: " + "; ".join(message for _, message in found)
        )
    return config


def _parse(
    raw: Any, shards: int, self_override: str | None, bind_override: str | None
) -> tuple[RaftConfig | None, list[tuple[str, str]]]:
    if raw is None:
        return None, []
    if not isinstance(raw, Mapping):
        return None, [("durable.E020", "DURABLE['RAFT'] must be None (off) or a dict")]
    out: list[tuple[str, str]] = []
    for key in sorted(set(map(str, raw)) - set(KEYS)):
        out.append(("durable.E020", f"Unknown DURABLE['RAFT'] key {key!r} (known: {KEYS})"))
    password = raw.get("PASSWORD")
    if not isinstance(password, str) or not password.strip():
        # Without a password pysyncobj neither encrypts nor authenticates, and unpickles
        # whatever any peer sends: never allowed.
        out.append(("durable.E022", "DURABLE['RAFT']['PASSWORD'] is mandatory (non-empty str)"))
    self_addr = self_override or raw.get("SELF")
    bind = bind_override or raw.get("BIND") or self_addr
    peers_raw = raw.get("PEERS", [])
    if not isinstance(peers_raw, list | tuple) or not all(isinstance(p, str) for p in peers_raw):
        out.append(("durable.E023", "DURABLE['RAFT']['PEERS'] must be a list of 'host:port'"))
        peers_raw = []
    named = [("SELF", self_addr), ("BIND", bind)] + [("PEERS", p) for p in peers_raw]
    for key, address in named:
        try:
            _, port = split_address(str(address) if address is not None else "")
        except ValueError as exc:
            out.append(("durable.E023", f"DURABLE['RAFT'][{key!r}]: {exc}"))
            continue
        if port + shards - 1 > 65535:
            out.append(
                (
                    "durable.E024",
                    f"DURABLE['RAFT'][{key!r}] {address!r}: base port + SHARDS - 1 "
                    f"({port + shards - 1}) is above 65535 (shard s listens on base + s)",
                )
            )
    if self_override is None and self_addr in peers_raw:
        out.append(
            (
                "durable.E025",
                f"DURABLE['RAFT']['SELF'] {self_addr!r} is also in PEERS (a node is not "
                "its own peer; --raft-self picks one of a shared list)",
            )
        )
    peers = tuple(sorted({*peers_raw, *([raw.get("SELF")] if raw.get("SELF") else [])}))
    peers = tuple(p for p in peers if p != self_addr)
    tick = _number(raw, "TICK_S", DEFAULT_TICK_S, out)
    heartbeat = _number(raw, "HEARTBEAT_S", DEFAULT_HEARTBEAT_S, out)
    balance = raw.get("BALANCE_S", DEFAULT_BALANCE_S)
    if isinstance(balance, bool) or not isinstance(balance, int | float) or balance < 0:
        out.append(("durable.E021", "DURABLE['RAFT']['BALANCE_S'] must be a number >= 0"))
        balance = DEFAULT_BALANCE_S
    election = raw.get("ELECTION_TIMEOUT_S", DEFAULT_ELECTION_TIMEOUT_S)
    ok_pair = (
        isinstance(election, list | tuple)
        and len(election) == 2
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in election)
    )
    if not ok_pair or not 0 < election[0] < election[1] <= 60:
        out.append(
            (
                "durable.E021",
                "DURABLE['RAFT']['ELECTION_TIMEOUT_S'] must be [low, high] seconds, "
                "0 < low < high <= 60",
            )
        )
        election = DEFAULT_ELECTION_TIMEOUT_S
    # pysyncobj's own rule: a follower must see several heartbeats per election timeout,
    # or it starts elections against a live leader.
    if election[0] <= 3 * heartbeat:
        out.append(
            (
                "durable.E021",
                "DURABLE['RAFT']['ELECTION_TIMEOUT_S'] low must be > 3 x HEARTBEAT_S",
            )
        )
    if tick > heartbeat:
        out.append(("durable.E021", "DURABLE['RAFT']['TICK_S'] must be <= HEARTBEAT_S"))
    if out:
        return None, out
    assert isinstance(self_addr, str) and isinstance(bind, str) and isinstance(password, str)
    return (
        RaftConfig(
            self_addr=self_addr,
            bind=bind,
            peers=peers,
            password=password,
            tick_s=tick,
            heartbeat_s=heartbeat,
            election_min_s=float(election[0]),
            election_max_s=float(election[1]),
            balance_s=float(balance),
        ),
        [],
    )


class RaftBindError(OSError):
    """A group could not bind its port; the message names the address."""


def check_bindable(address: str, shard: int) -> None:
    """Raise :class:`RaftBindError` now if ``address`` cannot be listened on (before
    pysyncobj tries, which retries in a loop and leaks a socket per attempt)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as pysyncobj does
            probe.bind(infos[0][4])
    except OSError as exc:
        raise RaftBindError(
            f"Raft: cannot listen on {address} (shard {shard}'s group): {exc.strerror or exc}; "
            "is the port in use, or the host not one of this machine's addresses? "
            "(DURABLE['RAFT']['BIND'] / --raft-bind)"
        ) from None


def election_window(config: RaftConfig, shard: int) -> tuple[float, float]:
    """This node's election timeout range in shard ``shard``'s group.

    ``ELECTION_TIMEOUT_S`` is cut into one slice per node, and each group ranks the nodes
    in a rotation of their sorted addresses (shard ``s`` starts at node ``s mod n``): the
    node ranked first times out first. With fully random timeouts in one shared range,
    the two survivors of a killed leader often stood for election together, split the
    vote and tried again (up to 3.3 s in the SIGKILL test, on a loaded machine); with
    slices, the next in rank wins at once, and at start-up the leaderships come out
    spread evenly across the nodes without any transfer.
    """
    nodes = sorted({config.self_addr, *config.peers})
    rank = (nodes.index(config.self_addr) - shard) % len(nodes)
    step = (config.election_max_s - config.election_min_s) / len(nodes)
    low = config.election_min_s + rank * step
    return low, low + step * 0.7
