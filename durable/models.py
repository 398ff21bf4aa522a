"""durable's models: the rows that make timers, leases and workflows durable."""

from __future__ import annotations
