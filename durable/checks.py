"""System checks (``manage.py check``) for durable's configuration.

Ids: ``durable.E001`` invalid DURABLE setting, ``durable.E002`` unknown database alias,
``durable.E003`` out-of-range number.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks


@checks.register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate ``settings.DURABLE``."""
    from durable.conf import DurableSettings

    try:
        conf = DurableSettings.from_dict(dict(getattr(settings, "DURABLE", {}) or {}))
    except (TypeError, ValueError) as exc:
        return [checks.Error(f"Invalid DURABLE setting: {exc}", id="durable.E001")]
    errors: list[checks.CheckMessage] = []
    if conf.DATABASE not in settings.DATABASES:
        errors.append(
            checks.Error(
                f"DURABLE['DATABASE'] = {conf.DATABASE!r} is not in settings.DATABASES",
                id="durable.E002",
            )
        )
    for name, low in (("SHARDS", 1), ("BATCH_SIZE", 1), ("HORIZON_BUCKETS", 1)):
        value = getattr(conf, name)
        if not isinstance(value, int) or value < low:
            errors.append(
                checks.Error(
                    f"DURABLE[{name!r}] must be an integer >= {low}, got {value!r}",
                    id="durable.E003",
                )
            )
    if not 8 <= conf.BUCKET_SHIFT <= 24:
        errors.append(
            checks.Error(
                f"DURABLE['BUCKET_SHIFT'] must be between 8 and 24, got {conf.BUCKET_SHIFT!r}",
                id="durable.E003",
            )
        )
    return errors
