"""``settings.DURABLE`` parsed once into a frozen :class:`DurableSettings`.

Read it with :func:`get_settings`; it is rebuilt when tests change ``DURABLE`` through
``override_settings`` (the ``setting_changed`` signal clears the cache). Misconfiguration
is reported by ``manage.py check`` (``durable.checks``), not by surprise at run time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver


@dataclass(frozen=True, slots=True, kw_only=True)
class DurableSettings:
    """Every knob durable reads, with its default. Keys of ``settings.DURABLE`` match names."""

    DATABASE: str = "default"
    """Database alias holding durable's rows; ``ctx.atomic`` is atomic with this one only."""
    SHARDS: int = 64
    """Number of shards; fixed once timers exist."""
    BUCKET_SHIFT: int = 16
    """bucket = fire_at_ms >> BUCKET_SHIFT (16: 65.5 s, one level-2 wheel slot)."""
    HORIZON_BUCKETS: int = 64
    """How many buckets ahead a worker holds in memory (64 x 65.5 s, about 70 min)."""
    LEASE_TTL_S: float = 10.0
    """A shard lease expires this long after its last renewal."""
    RESCAN_INTERVAL_S: float = 2.0
    """Every loaded bucket is re-read this often, so a lost NOTIFY only delays a fire."""
    BATCH_SIZE: int = 500
    """Most timers fired in one transaction."""
    BATCH_TIME_BUDGET_S: float = 2.0
    """A batch stops taking new timers after this long, so one slow handler can't stall it."""
    CLAIM_TIMEOUT_S: float = 300.0
    """An external (non-atomic) fire not completed in this long is run again (on a live
    owner; a new owner re-runs the old owner's claims at once)."""
    ATOMIC_TIMEOUT_S: float = 5.0
    """An atomic handler running longer is interrupted and its attempt fails (it holds
    its batch and the worker's loop: keep it below ``LEASE_TTL_S``)."""
    HANDLER_TIMEOUT_S: float = 240.0
    """An external handler or task running longer is abandoned and its attempt fails
    (below ``CLAIM_TIMEOUT_S``, so it is never run twice at once)."""
    SHUTDOWN_GRACE_S: float = 30.0
    """On SIGTERM, how long the worker waits for running handlers before it exits."""
    MAX_ATTEMPTS: int = 5
    """Default attempts before a timer is dead-lettered (state failed)."""
    BACKOFF_BASE_S: float = 1.0
    BACKOFF_MAX_S: float = 3600.0
    RETENTION_DAYS: float = 7.0
    """Fired and cancelled rows are pruned after this many days."""
    MAX_PAYLOAD_BYTES: int = 64 * 1024
    """Largest JSON payload (args, kwargs, context) accepted by schedule()."""
    NOTIFY: bool = True
    """Send PostgreSQL NOTIFY in the scheduling transaction (ignored on other databases)."""
    DISPATCH: str = "inline"
    BROKER_URL: str = "memory://"
    CRONS: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DurableSettings:
        """Build from ``settings.DURABLE``; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"Unknown DURABLE setting(s): {', '.join(unknown)}")
        return cls(**raw)


@cache
def get_settings() -> DurableSettings:
    """Return the current :class:`DurableSettings` (cached until ``DURABLE`` changes)."""
    return DurableSettings.from_dict(dict(getattr(settings, "DURABLE", {}) or {}))


@receiver(setting_changed)
def _reset(*, setting: str, **_: Any) -> None:
    if setting == "DURABLE":
        get_settings.cache_clear()
