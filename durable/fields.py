"""Model fields of durable's own: timestamps stamped from the injected clock."""

from __future__ import annotations

from typing import Any

from django.db import models

from durable.core.clock import current_datetime


class ClockStampField(models.DateTimeField):
    """A datetime column durable fills from its injected clock when a row is inserted
    without one (``durable.core.clock.current_datetime()``).

    Django's ``auto_now``/``auto_now_add`` read the wall clock, so under
    ``durable.testing.time_machine`` they disagreed with every other time, and they
    overwrite a time the code gives (a checkpoint's, a signal's). This field keeps a
    time it is given; updates stamp ``updated_at`` themselves, with the caller's clock.
    The column is an ordinary ``DateTimeField``'s.
    """

    def get_internal_type(self) -> str:
        return "DateTimeField"  # the column type, and the ORM's lookups and casts

    def pre_save(self, model_instance: models.Model, add: bool) -> Any:
        value = getattr(model_instance, self.attname)
        if value is None:
            value = current_datetime()
            setattr(model_instance, self.attname, value)
        return value


def clock_stamp() -> ClockStampField:
    """A ``created_at``/``updated_at`` of durable's models: a :class:`ClockStampField`
    that forms never edit (as ``auto_now`` fields were)."""
    return ClockStampField(editable=False, blank=True)
