"""System checks (``manage.py check``) for durable's configuration and shards.

Settings (:func:`check_settings`, rules in :mod:`durable.conf`): ``durable.E001``
``DURABLE`` is not a dict or has an unknown key, ``E002`` ``DATABASE`` is not an alias of
``settings.DATABASES``, ``E003`` a value of the wrong type or out of range, ``E004``
``DISPATCH`` is not a known mode, ``E005`` two settings that must agree do not.
Schedules: ``E010``-``E019`` (:func:`check_crons`). With a database
(``manage.py check --database default``, and always at worker start):
``E006`` orphaned shards, ``W001`` lease rows beyond ``SHARDS``, ``W002`` the shards
could not be looked at. ``W003`` preparing is on for a pooled ``DATABASE``, ``W004``
``LISTEN_DATABASE`` names another database (:func:`check_listen_database`). Every
problem is reported, one message per key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core import checks

if TYPE_CHECKING:
    from django.core.management.base import BaseCommand

    from durable.storage.status import OrphanedShard, ShardStatus

TAG = "durable"
"""Tag of the checks a worker always runs before it starts (``--skip-checks`` or not)."""


@checks.register(TAG)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Validate ``settings.DURABLE``: every key's type and range, and keys that must agree."""
    from durable.conf import find_problems, raw_settings

    return [
        checks.Error(problem.message, hint=problem.hint, id=problem.id)
        for problem in find_problems(raw_settings())
        # CRONS that is not a dict is reported by check_crons (durable.E015).
        if problem.keys != ("CRONS",)
    ]


@checks.register(TAG, checks.Tags.database)
def check_orphaned_shards(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Report work on shards ``>= SHARDS``, which no worker owns (after SHARDS was lowered).

    Touches the database, so runs only when asked for ``DURABLE["DATABASE"]`` (Django's
    ``databases`` argument: ``manage.py check --database default``, the worker's start).
    """
    from django.core.exceptions import ImproperlyConfigured
    from django.db import DatabaseError

    from durable.conf import get_settings
    from durable.core.clock import current_clock
    from durable.storage import status

    try:
        conf = get_settings()
    except ImproperlyConfigured:
        return []  # reported by check_settings
    if not databases or conf.DATABASE not in databases:
        return []
    try:
        if not status.tables_exist(conf.DATABASE):
            return []  # not migrated yet (``migrate`` runs database checks too): no timers
        orphans = status.orphaned_shards(conf.DATABASE, conf.SHARDS)
        leases = status.leases_beyond(conf.DATABASE, conf.SHARDS, current_clock().now_ms())
    except DatabaseError as exc:  # unreachable: the worker waits for it as it always does
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return [
            checks.Warning(
                f"Could not look for orphaned shards in database {conf.DATABASE!r}: {first}",
                hint="Check that the database is reachable and migrated.",
                id="durable.W002",
            )
        ]
    messages: list[checks.CheckMessage] = []
    if orphans:
        messages.append(_orphans_error(orphans, conf.SHARDS))
    if leases:
        messages.append(_leases_warning(leases, conf.SHARDS))
    return messages


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _orphans_error(orphans: list[OrphanedShard], shard_count: int) -> checks.CheckMessage:
    shown = []
    for o in orphans[:10]:
        parts = [
            _plural(o.pending, "pending timer") if o.pending else "",
            _plural(o.firing, "firing timer") if o.firing else "",
            _plural(o.runs, "unfinished workflow run") if o.runs else "",
        ]
        shown.append(f"shard {o.shard}: " + ", ".join(p for p in parts if p))
    more = f"; and {len(orphans) - 10} more shards" if len(orphans) > 10 else ""
    pending = sum(o.pending for o in orphans)
    firing = sum(o.firing for o in orphans)
    runs = sum(o.runs for o in orphans)
    return checks.Error(
        f"{_plural(len(orphans), 'shard')} at or above DURABLE['SHARDS'] = {shard_count} "
        f"hold work no worker will run ({_plural(pending, 'pending timer')}, "
        f"{_plural(firing, 'firing timer')}, {_plural(runs, 'unfinished workflow run')}): "
        + "; ".join(shown)
        + more,
        hint=f"SHARDS was lowered while timers existed. Set DURABLE['SHARDS'] back to "
        f"{orphans[-1].shard + 1} or more: the shard count is fixed once timers exist.",
        id="durable.E006",
    )


def _leases_warning(leases: list[ShardStatus], shard_count: int) -> checks.CheckMessage:
    numbers = ", ".join(str(s.shard) for s in leases[:20])
    if len(leases) > 20:
        numbers += f" and {len(leases) - 20} more"
    held = [f"shard {s.shard} by {s.owner!r}" for s in leases if s.live][:5]
    live = (
        f"; held right now ({', '.join(held)}): a worker runs with a larger SHARDS" if held else ""
    )
    return checks.Warning(
        f"Shard lease rows exist beyond DURABLE['SHARDS'] = {shard_count}: shards {numbers}{live}",
        hint="They are left from a larger SHARDS (durable.E006 says whether those shards "
        f"still hold work). Once every worker runs with SHARDS = {shard_count}, delete them: "
        f"durable.models.ShardLease.objects.filter(shard__gte={shard_count}).delete()",
        id="durable.W001",
    )


def run_worker_checks(command: BaseCommand, *, everything: bool, shards: bool) -> None:
    """Before a worker starts: run the checks, raise ``SystemCheckError`` on any error.

    durable's own checks (tag ``durable``: the settings, and with ``shards`` the orphaned
    shards of ``DURABLE["DATABASE"]``) always run; ``everything`` adds the project's other
    checks (what ``--skip-checks`` turns off). Warnings go to the command's stderr.
    """
    from durable.conf import DatabaseAlias, raw_settings

    raw = raw_settings()
    alias = raw.get("DATABASE", "default") if isinstance(raw, Mapping) else None
    databases = [alias] if shards and DatabaseAlias()(alias) else None
    command.check(tags=None if everything else [TAG], databases=databases)


# Schedules: durable.E010 invalid cron expression, E011 unknown time zone, E012 unknown
# catch-up policy, E013 unknown overlap policy, E014 duplicate schedule name, E015
# malformed DURABLE["CRONS"] entry, E016 function not importable or of the wrong shape,
# E017 invalid interval or anchor, E018 invalid grace, atomic or kwargs, E019 invalid
# name. Each message names the decorated function or the CRONS entry, and every problem
# of a declaration is its own message.
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
        # Decorators validate as they run; a module stops at its first bad declaration
        # (that is how imports work), whose problems are all reported.
        autodiscover_modules("crons")
    except ScheduleError as exc:
        errors += _schedule_errors(exc)
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
            errors += _schedule_errors(exc)
        if name in decorated:
            errors.append(
                checks.Error(
                    f"DURABLE['CRONS'][{name!r}]: a schedule of that name is also declared "
                    "with @durable.cron / @durable.every",
                    id="durable.E014",
                )
            )
    return errors


def _schedule_errors(exc: Exception) -> list[checks.CheckMessage]:
    """One check message per problem a ``ScheduleError`` lists (itself if it lists none)."""
    problems = getattr(exc, "problems", None) or [exc]
    return [checks.Error(str(p), id=getattr(p, "check_id", "durable.E015")) for p in problems]


# durable.E007: DURABLE["IMPORTS"] names a module that cannot be found. Its type (a list
# of non-empty strings) is the settings rules' (durable.conf.RULES, E003).
@checks.register()
def check_imports(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Report the modules of ``DURABLE["IMPORTS"]`` that do not exist."""
    from importlib.util import find_spec

    imports = (getattr(settings, "DURABLE", None) or {}).get("IMPORTS", [])
    if not isinstance(imports, list | tuple):
        return []  # reported by check_settings
    errors: list[checks.CheckMessage] = []
    for index, name in enumerate(imports):
        if not isinstance(name, str) or not name:
            continue  # reported by check_settings
        try:
            found = find_spec(name) is not None  # imports its parent packages only
        except (ImportError, ValueError):
            found = False
        if not found:
            where = f"DURABLE['IMPORTS'][{index}]"
            errors.append(checks.Error(f"{where}: no module named {name!r}", id="durable.E007"))
    return errors


# durable.W003: preparing is on for a DATABASE that a LISTEN_DATABASE says is pooled;
# durable.W004: LISTEN_DATABASE names another database than DATABASE.
@checks.register(TAG)
def check_listen_database(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check ``DURABLE["LISTEN_DATABASE"]`` against ``DATABASE`` (see docs: Deploying)."""
    from django.core.exceptions import ImproperlyConfigured

    from durable.conf import get_settings

    try:
        conf = get_settings()
    except ImproperlyConfigured:
        return []  # reported by check_settings
    if conf.LISTEN_DATABASE is None or conf.LISTEN_DATABASE == conf.DATABASE:
        return []
    main = settings.DATABASES[conf.DATABASE]
    listen = settings.DATABASES[conf.LISTEN_DATABASE]
    messages: list[checks.CheckMessage] = []
    threshold = (main.get("OPTIONS") or {}).get("prepare_threshold")
    if main.get("ENGINE", "").endswith("postgresql") and threshold is not None:
        messages.append(
            checks.Warning(
                f"DATABASES[{conf.DATABASE!r}]['OPTIONS']['prepare_threshold'] is "
                f"{threshold!r} while DURABLE['LISTEN_DATABASE'] ({conf.LISTEN_DATABASE!r}) "
                "says that database is reached through a pooler",
                hint="A pooler in transaction mode hands each transaction any server "
                "connection: statements prepared on one are missing on the next (PgBouncer "
                "before 1.21, or without max_prepared_statements). Remove prepare_threshold "
                "unless the pooler carries prepared statements.",
                id="durable.W003",
            )
        )
    elif main.get("ENGINE", "").endswith("postgresql") and conf.PREPARE_STATEMENTS is True:
        messages.append(
            checks.Warning(
                f"DURABLE['PREPARE_STATEMENTS'] is True while DURABLE['LISTEN_DATABASE'] "
                f"({conf.LISTEN_DATABASE!r}) says DATABASES[{conf.DATABASE!r}] is reached "
                "through a pooler",
                hint="The worker then prepares its statements through the pooler: keep it "
                "only if the pooler carries prepared statements (PgBouncer 1.21+ with "
                "max_prepared_statements); else leave PREPARE_STATEMENTS at None.",
                id="durable.W003",
            )
        )
    if main.get("NAME") != listen.get("NAME"):
        messages.append(
            checks.Warning(
                f"DURABLE['LISTEN_DATABASE'] ({conf.LISTEN_DATABASE!r}) names database "
                f"{listen.get('NAME')!r}, DURABLE['DATABASE'] ({conf.DATABASE!r}) names "
                f"{main.get('NAME')!r}: notifications are sent in the latter",
                hint="The listen alias must reach the same database, directly (not through "
                "the pooler). Without the notifications every fire waits for the rescan.",
                id="durable.W004",
            )
        )
    return messages


# durable.E020 RAFT not a dict or unknown key, E021 a tuning key out of range, E022 no
# PASSWORD, E023 a malformed address, E024 base port + SHARDS - 1 above 65535, E025 SELF
# among PEERS, E026 RAFT on with SQLite, E027 pysyncobj or cryptography missing.
@checks.register(TAG)
def check_raft(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Check ``DURABLE["RAFT"]`` (docs: settings reference, "Raft")."""
    import importlib.util

    from django.core.exceptions import ImproperlyConfigured

    from durable.conf import get_settings
    from durable.raft.config import problems

    try:
        conf = get_settings()
    except ImproperlyConfigured:
        return []  # reported by check_settings
    if conf.RAFT is None:
        return []
    messages: list[checks.CheckMessage] = [
        checks.Error(message, id=check_id) for check_id, message in problems(conf.RAFT, conf.SHARDS)
    ]
    if settings.DATABASES[conf.DATABASE].get("ENGINE", "").endswith("sqlite3"):
        messages.append(
            checks.Error(
                f"DURABLE['RAFT'] is set but DATABASES[{conf.DATABASE!r}] is SQLite",
                hint="Raft hands shards between worker nodes that share one database server; "
                "a SQLite file is not shared between hosts, and SQLite has no row locks "
                "for the fence to wait on. Set RAFT to None, or use PostgreSQL.",
                id="durable.E026",
            )
        )
    missing = [m for m in ("pysyncobj", "cryptography") if importlib.util.find_spec(m) is None]
    if missing:
        messages.append(
            checks.Error(
                f"DURABLE['RAFT'] is set but {' and '.join(missing)} cannot be imported",
                hint="pip install 'django-durable[raft]'",
                id="durable.E027",
            )
        )
    return messages
