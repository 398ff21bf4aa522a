"""Lateness: how late the worker may fire after each kind of fault (the documented bounds).

Pure, like :mod:`chaos.checker`, which uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    """The documented times the checker holds the worker to (durable's defaults)."""

    lease_ttl_s: float = 10.0
    rescan_s: float = 2.0
    batch_budget_s: float = 2.0
    atomic_timeout_s: float = 5.0

    @property
    def healthy_ms(self) -> int:
        """Lateness allowed with no fault near: two rescans and a batch budget, plus 1 s."""
        return int((2 * self.rescan_s + self.batch_budget_s + 1) * 1000)

    def after(self, fault: dict[str, Any]) -> int:
        """When the worker must have recovered from ``fault``, counted from its start."""
        kind = fault["kind"]
        ttl = self.lease_ttl_s * 1000
        span = fault.get("end_ms", fault["start_ms"]) - fault["start_ms"]
        if kind in ("kill", "crash"):  # docs/how-to/run-the-worker.md: LEASE_TTL_S + 2 s
            return int(ttl + 2000)
        if kind == "stop":
            # Resumed, or taken over once its leases expired; but a worker frozen inside
            # its loop's transaction keeps its lease row locked (others skip it) until
            # PostgreSQL aborts that transaction, after twice LEASE_TTL_S
            # (durable.worker.housekeeping.guard_session).
            return int(min(span, 2 * ttl) + 2000)
        if kind in ("terminate", "listen"):  # reconnect, then the rescan finds what is due
            return int(2 * self.rescan_s * 1000 + 1000)
        if kind in ("lock", "pg_restart"):  # whatever it blocked, then a reconnect and rescan
            return int(span + 5000 + 2 * self.rescan_s * 1000)
        if kind == "poison_hang":  # it held its worker's loop from start to end
            return int(span + 2000)
        return self.healthy_ms


def explain(
    due: int, fired: int, faults: list[dict[str, Any]], bounds: Bounds, *, chain: bool = True
) -> tuple[int, list[dict[str, Any]]]:
    """When a fire due at ``due`` may come at the latest, and the faults that explain it.

    A fault's recovery is due :meth:`Bounds.after` its start (for one that lasts, a
    freeze or a held lock, that is a fixed time after its end). It explains a late fire
    if its recovery was not over at the due time and it began while the fire could
    still be waiting within its bounds: before its due time plus the healthy lateness,
    or during the recovery from a fault that already explains it (a fault that strikes
    while the worker recovers from another starts the recovery over, so the bound
    counts from the end of the last one). The fire may come as late as the latest
    recovery of the faults that explain it. ``chain=False``: only faults that began
    before the due time plus the healthy lateness count.
    """
    allowed = due + bounds.healthy_ms
    cover: list[dict[str, Any]] = []
    left = sorted(faults, key=lambda f: f["start_ms"])
    grew = True
    while grew:
        grew = False
        for fault in list(left):
            start = fault["start_ms"]
            if start > min(fired, allowed if chain else due + bounds.healthy_ms):
                break  # sorted by start: none of the rest began in time (yet)
            if due <= start + bounds.after(fault):
                cover.append(fault)
                left.remove(fault)
                allowed = max(allowed, start + bounds.after(fault))
                grew = True
    return allowed, cover
