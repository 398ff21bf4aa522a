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
    if conf.DISPATCH not in ("inline", "kombu"):
        errors.append(
            checks.Error(
                f"DURABLE['DISPATCH'] must be 'inline' or 'kombu', got {conf.DISPATCH!r}",
                id="durable.E004",
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


# Schedules: durable.E010 invalid cron expression, E011 unknown time zone, E012 unknown
# catch-up policy, E013 unknown overlap policy, E014 duplicate schedule name, E015
# malformed DURABLE["CRONS"] entry, E016 handler not importable or of the wrong shape,
# E017 invalid interval or anchor, E018 invalid grace or atomic, E019 invalid name.
@checks.register()
def check_crons(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate the declared schedules: ``DURABLE["CRONS"]`` and the decorators."""
    from django.utils.module_loading import autodiscover_modules

    from durable.conf import DurableSettings
    from durable.exceptions import ScheduleError
    from durable.scheduling.cron import declared
    from durable.scheduling.specs import settings_spec

    try:
        crons = DurableSettings.from_dict(dict(getattr(settings, "DURABLE", {}) or {})).CRONS
    except (TypeError, ValueError):
        return []  # reported as durable.E001
    errors: list[checks.CheckMessage] = []
    try:
        autodiscover_modules("crons")  # decorators validate as they run
    except ScheduleError as exc:
        errors.append(checks.Error(str(exc), id=getattr(exc, "check_id", "durable.E015")))
    if not isinstance(crons, dict):
        errors.append(
            checks.Error(
                f"DURABLE['CRONS'] must be a dict of name -> entry, got {type(crons).__name__}",
                id="durable.E015",
            )
        )
        return errors
    decorated = {spec.name for spec in declared.specs()}
    for name, entry in crons.items():
        try:
            settings_spec(name, entry)
        except ScheduleError as exc:
            errors.append(checks.Error(str(exc), id=getattr(exc, "check_id", "durable.E015")))
        if name in decorated:
            errors.append(
                checks.Error(
                    f"DURABLE['CRONS'][{name!r}]: a schedule of that name is also declared "
                    "with @durable.cron / @durable.every",
                    id="durable.E014",
                )
            )
    return errors


# durable.E030: DURABLE["IMPORTS"] is not a list of importable module names.
@checks.register()
def check_imports(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate ``DURABLE["IMPORTS"]``: a list of module names that exist."""
    from importlib.util import find_spec

    imports = (getattr(settings, "DURABLE", None) or {}).get("IMPORTS", [])
    if isinstance(imports, str) or not isinstance(imports, list | tuple):
        return [
            checks.Error(
                f"DURABLE['IMPORTS'] must be a list of module names, got {imports!r}",
                id="durable.E030",
            )
        ]
    errors: list[checks.CheckMessage] = []
    for index, name in enumerate(imports):
        where = f"DURABLE['IMPORTS'][{index}]"
        if not isinstance(name, str) or not name:
            errors.append(
                checks.Error(f"{where} must be a module name, got {name!r}", id="durable.E030")
            )
            continue
        try:
            found = find_spec(name) is not None  # imports its parent packages only
        except (ImportError, ValueError):
            found = False
        if not found:
            errors.append(checks.Error(f"{where}: no module named {name!r}", id="durable.E030"))
    return errors
