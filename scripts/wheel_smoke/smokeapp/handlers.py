"""Timer handlers: atomic, external (``atomic=False``) and one that always fails."""

from __future__ import annotations

import durable
from smokeapp.models import Fired


@durable.handler
def record(what: str) -> None:
    """Runs in the transaction that marks its timer fired."""
    Fired.objects.create(what=what)


@durable.handler(atomic=False)
def record_outside(what: str) -> None:
    """Runs on an executor thread, outside the firing transaction."""
    Fired.objects.create(what=what)


@durable.handler(max_attempts=1)
def explode(what: str) -> None:
    """Fails at once, so the admin has a failed timer with an error to show."""
    raise RuntimeError(f"smoke: {what} always fails")
