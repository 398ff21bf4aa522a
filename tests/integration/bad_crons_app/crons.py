"""A schedule with three problems: the import fails at it, and the check reports all three."""

from __future__ import annotations

import durable


@durable.cron("0 25 * * *", tz="Mars/Olympus", kwargs={"colour": "red"})
def nightly(occurrence: durable.Occurrence) -> None:
    """Takes no ``colour``: the kwargs do not bind."""
