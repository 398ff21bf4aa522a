"""Structured log events: ``event.name key=value ...`` plus the same fields in ``extra``.

The message reads well in a terminal and greps well; a JSON formatter finds every field
under ``record.durable`` without parsing the message.
"""

from __future__ import annotations

import logging
from typing import Any


def event(logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
    """Log event ``name`` with ``fields`` at ``level``."""
    if not logger.isEnabledFor(level):
        return
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    logger.log(level, "%s %s", name, text, extra={"durable": {"event": name, **fields}})
