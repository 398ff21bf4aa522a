"""``settings.DURABLE`` parsed once into a frozen :class:`DurableSettings`, and checked.

Read it with :func:`get_settings`; it is rebuilt when tests change ``DURABLE`` through
``override_settings`` (the ``setting_changed`` signal clears the cache).

Every key has a rule in :data:`RULES` (its type and range) and pairs of keys that must
agree have one in :data:`RELATIONS`; :func:`find_problems` applies them all and reports
every problem, not the first. ``manage.py check`` shows them (``durable.checks``), the
worker commands refuse to start on any of them, and :func:`get_settings` raises
``ImproperlyConfigured`` naming the keys whose value cannot be used at all, rather than
letting a ``TypeError`` surface deep inside the worker. A new key needs one line in
:data:`RULES`; a unit test fails for a key without one. The kinds of rule (``Integer``,
``Number``, ``DatabaseAlias``...) live in :mod:`durable.settings_kinds`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

from durable.settings_kinds import (
    Check,
    DatabaseAlias,
    Integer,
    Number,
    Predicate,
    Problem,
    Relation,
    Rule,
    show_number,
    show_value,
)

__all__ = [
    "RELATIONS",
    "RULES",
    "Check",
    "DatabaseAlias",
    "DurableSettings",
    "Integer",
    "Number",
    "Predicate",
    "Problem",
    "Relation",
    "Rule",
    "find_problems",
    "get_settings",
    "raw_settings",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class DurableSettings:
    """Every knob durable reads, with its default. Keys of ``settings.DURABLE`` match names."""

    DATABASE: str = "default"
    """Database alias holding durable's rows; ``ctx.atomic`` is atomic with this one only."""
    LISTEN_DATABASE: str | None = None
    """Alias the worker LISTENs through (None: ``DATABASE``). Behind a transaction-mode
    pooler, an alias connecting to the same database directly: LISTEN needs a session."""
    PREPARE_STATEMENTS: bool | None = None
    """Whether the worker's PostgreSQL connections prepare durable's hot statements (psycopg
    3). None: yes, unless ``LISTEN_DATABASE`` names another alias (a pooler in transaction
    mode); True: always; False: never (the project's ``prepare_threshold`` decides)."""
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
    """An atomic handler running longer is interrupted and its attempt fails. It holds its
    batch and the worker's loop, so the deadline is never more than half of
    ``LEASE_TTL_S``, whatever this or a handler's ``timeout=`` says."""
    HANDLER_TIMEOUT_S: float = 240.0
    """An external handler or task running longer is abandoned and its attempt fails. Never
    more than ``CLAIM_TIMEOUT_S``, whatever this or a handler's ``timeout=`` says, so it is
    never run twice at once."""
    ASYNC_COMMIT: bool = False
    """Opt-in speed: workflow checkpoints and batches that only claim commit asynchronously
    on PostgreSQL. A database crash can then take back their last moments (see the
    settings reference for what that risks)."""
    SHUTDOWN_GRACE_S: float = 30.0
    """On SIGTERM, how long the worker waits for running handlers before it exits."""
    MAX_ATTEMPTS: int = 5
    """Default attempts before a timer is dead-lettered (state failed)."""
    BACKOFF_BASE_S: float = 1.0
    BACKOFF_MAX_S: float = 3600.0
    RETENTION_DAYS: float = 7.0
    """Fired and cancelled timers (and so their keys) are kept this many days."""
    FAILED_RETENTION_DAYS: float | None = 30.0
    """Failed (dead-lettered) timers are kept this many days; None: forever."""
    RUN_RETENTION_DAYS: float | None = 30.0
    """Finished workflow runs, with steps and signals, are kept this many days; None: forever."""
    MAX_PAYLOAD_BYTES: int = 64 * 1024
    """Largest JSON payload (args, kwargs, context; a signal's payload) accepted by
    schedule(), a workflow start and send_signal()."""
    MAX_RESULT_BYTES: int = 1024 * 1024
    """Largest JSON result stored: a step's, a workflow's, a handler's (for on_complete)
    or a Django task's return value. A larger one fails the step, run or attempt."""
    MAX_STEPS_PER_RUN: int = 10_000
    """Most ctx calls (steps, sleeps, signals, ...) one workflow run may record; every
    replay reads them all. The call past the limit fails the run."""
    NOTIFY: bool = True
    """Send PostgreSQL NOTIFY in the scheduling transaction (ignored on other databases)."""
    DISPATCH: str = "inline"
    BROKER_URL: str = "memory://"
    CRONS: dict[str, Any] = field(default_factory=dict)
    IMPORTS: list[str] = field(default_factory=list)
    """Modules the worker imports at start-up, besides every installed app's ``handlers``,
    ``workflows``, ``crons`` and ``tasks``: where handlers, workflows, schedules and tasks
    kept elsewhere are registered (``["myapp.services"]``)."""
    RAFT: dict[str, Any] | None = None
    """Raft beside the leases (``durable.raft``): ``{"SELF": "host:port", "PEERS": [...],
    "PASSWORD": "..."}`` plus optional keys (docs/reference/settings.md). None: off, the
    leases alone decide who owns a shard."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DurableSettings:
        """Build from ``settings.DURABLE``; unknown keys raise ``ValueError`` naming them.

        Values are taken as they are: :func:`find_problems` is what checks them.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(raw) - known))
        if unknown:
            raise ValueError(f"Unknown DURABLE setting(s): {', '.join(unknown)}")
        return cls(**raw)


# --- rules: one per key ------------------------------------------------------------------

# Instants computed from these durations (claim deadlines, retry times) must stay far
# inside the 64-bit millisecond columns and Python's datetimes: a year is plenty for any.
YEAR_S = 365 * 86_400
# The worker asks PostgreSQL to abort its transactions left idle for 2 x LEASE_TTL_S
# (housekeeping.guard_session); that setting takes at most 2**31 - 1 milliseconds.
MAX_LEASE_TTL_S = 1_000_000


_DAYS = Number(0, 36_500)
_DAYS_OR_NONE = Predicate(
    lambda v: v is None or _DAYS(v), f"None (keep forever) or {_DAYS.requirement}"
)

RULES: dict[str, Rule] = {
    "DATABASE": Rule(DatabaseAlias(), id="durable.E002"),
    "LISTEN_DATABASE": Rule(DatabaseAlias(optional=True), id="durable.E002"),
    "PREPARE_STATEMENTS": Rule(
        Predicate(lambda v: v is None or isinstance(v, bool), "None, True or False")
    ),
    # Shard numbers live in smallint columns (Timer, WorkflowRun, ShardLease).
    "SHARDS": Rule(Integer(1, 32_767)),
    "BUCKET_SHIFT": Rule(Integer(8, 24)),
    "HORIZON_BUCKETS": Rule(Integer(1, 1_000_000)),
    # Renewed every TTL / 3: below a second, a GC pause or one slow query loses leases.
    "LEASE_TTL_S": Rule(Number(1, MAX_LEASE_TTL_S)),
    # The worker counts in whole milliseconds.
    "RESCAN_INTERVAL_S": Rule(Number(0.001, YEAR_S)),
    "BATCH_SIZE": Rule(Integer(1)),
    "BATCH_TIME_BUDGET_S": Rule(Number(0, YEAR_S, above=True)),
    "CLAIM_TIMEOUT_S": Rule(Number(0, YEAR_S, above=True)),
    # Capped at run time (by LEASE_TTL_S / 2 and CLAIM_TIMEOUT_S): no relation needed.
    "ATOMIC_TIMEOUT_S": Rule(Number(0, YEAR_S, above=True)),
    "HANDLER_TIMEOUT_S": Rule(Number(0, YEAR_S, above=True)),
    "ASYNC_COMMIT": Rule(Predicate(lambda v: isinstance(v, bool), "True or False")),
    "SHUTDOWN_GRACE_S": Rule(Number(0, YEAR_S)),
    # Timer.max_attempts is a 32-bit integer column.
    "MAX_ATTEMPTS": Rule(Integer(1, 2_147_483_647)),
    "BACKOFF_BASE_S": Rule(Number(0, YEAR_S, above=True)),
    "BACKOFF_MAX_S": Rule(Number(0, YEAR_S, above=True)),
    # 0: pruned at the next pass; the cutoff must stay a representable datetime.
    "RETENTION_DAYS": Rule(_DAYS),
    "FAILED_RETENTION_DAYS": Rule(_DAYS_OR_NONE),
    "RUN_RETENTION_DAYS": Rule(_DAYS_OR_NONE),
    "MAX_PAYLOAD_BYTES": Rule(Integer(1)),
    "MAX_RESULT_BYTES": Rule(Integer(1)),
    "MAX_STEPS_PER_RUN": Rule(Integer(1, 1_000_000)),
    "NOTIFY": Rule(Predicate(lambda v: isinstance(v, bool), "True or False")),
    "DISPATCH": Rule(
        Predicate(lambda v: v in ("inline", "kombu"), "one of 'inline', 'kombu'"), id="durable.E004"
    ),
    "BROKER_URL": Rule(
        Predicate(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
    ),
    # Each entry is checked by durable.checks.check_crons (E010-E019), which also
    # reports a CRONS that is not a dict (E015).
    "CRONS": Rule(Predicate(lambda v: isinstance(v, dict), "a dict"), id="durable.E015"),
    # Whether each module exists is checked by durable.checks.check_imports (E007).
    "IMPORTS": Rule(
        Predicate(
            lambda v: isinstance(v, list | tuple) and all(isinstance(m, str) and m for m in v),
            "a list of module paths (non-empty strings)",
        )
    ),
    # Its keys are checked by durable.checks.check_raft (E020-E026, W005).
    "RAFT": Rule(
        Predicate(lambda v: v is None or isinstance(v, dict), "None (off) or a dict"),
        id="durable.E020",
    ),
}
"""Key → rule. Every field of :class:`DurableSettings` must have one (a test says so)."""


RELATIONS: tuple[Relation, ...] = (
    Relation(
        "RESCAN_INTERVAL_S",
        "LEASE_TTL_S",
        lambda a, b: a < b,
        "less than",
        "the rescan bounds how late a timer is when its NOTIFY was lost (and on databases "
        "without NOTIFY); a bound longer than a lease's life is a mistake",
    ),
    Relation(
        "BATCH_TIME_BUDGET_S",
        "LEASE_TTL_S",
        lambda a, b: a < b,
        "less than",
        "leases are renewed between batches, never during one: a batch that spends its "
        "budget would let every lease of its worker lapse",
    ),
    Relation(
        "BATCH_TIME_BUDGET_S",
        "CLAIM_TIMEOUT_S",
        lambda a, b: a < b,
        "less than",
        "a claim's deadline is set when its batch starts and its handler starts after the "
        "batch commits: the claim could expire before the handler runs, which runs it twice",
    ),
    Relation(
        "BACKOFF_BASE_S",
        "BACKOFF_MAX_S",
        lambda a, b: a <= b,
        "at most",
        "the first retry's delay cannot exceed the cap on every delay",
    ),
)
"""Pairs of keys that must agree (``durable.E005``)."""


def raw_settings() -> Any:
    """``settings.DURABLE`` as written (absent or ``None`` reads as ``{}``)."""
    raw = getattr(settings, "DURABLE", None)
    return {} if raw is None else raw


def find_problems(raw: Any) -> list[Problem]:
    """Every problem of ``raw`` (a ``settings.DURABLE`` value), in key order; [] if none.

    Not a dict: one problem. Otherwise one per unknown key, one per key whose value breaks
    its rule, and one per relation broken by values that are each fine on their own.
    """
    if not isinstance(raw, Mapping):
        return [
            Problem(
                "durable.E001",
                (),
                f"settings.DURABLE must be a dict of setting name -> value, got {show_value(raw)}",
                hint='e.g. DURABLE = {"SHARDS": 64}',
            )
        ]
    problems = [
        Problem(
            "durable.E001",
            (str(key),),
            f"Unknown DURABLE setting {key!r}",
            hint="known settings: " + ", ".join(RULES),
        )
        for key in sorted(set(raw) - set(RULES), key=repr)
    ]
    values = {
        f.name: getattr(DurableSettings(), f.name) for f in dataclasses.fields(DurableSettings)
    }
    for key, rule in RULES.items():
        if key not in raw:
            continue
        if rule.check(raw[key]):
            values[key] = raw[key]
            continue
        values.pop(key, None)
        problems.append(
            Problem(
                rule.id,
                (key,),
                f"DURABLE[{key!r}] must be {rule.requirement}, got {show_value(raw[key])}",
            )
        )
    for rel in RELATIONS:
        if rel.first not in values or rel.second not in values:
            continue  # a bad value is reported on its own
        first, second = values[rel.first], values[rel.second]
        if not rel.holds(first, second):
            problems.append(
                Problem(
                    "durable.E005",
                    (rel.first, rel.second),
                    f"DURABLE[{rel.first!r}] ({show_number(first)}) must be {rel.requirement} "
                    f"DURABLE[{rel.second!r}] ({show_number(second)})",
                    hint=f"{rel.why[0].upper()}{rel.why[1:]}.",
                )
            )
    return problems


@cache
def get_settings() -> DurableSettings:
    """Return the current :class:`DurableSettings` (cached until ``DURABLE`` changes).

    Raises ``ImproperlyConfigured`` naming every key whose value cannot be used (not a
    dict, unknown key, wrong type or out of range). Keys that only disagree with each
    other (``durable.E005``) do not raise here: they are reported by ``manage.py check``,
    and the worker refuses to start on them.
    """
    raw = raw_settings()
    problems = [p for p in find_problems(raw) if p.unusable]
    if problems:
        raise ImproperlyConfigured(
            "settings.DURABLE is invalid (`manage.py check` lists every problem): "
            + "; ".join(p.message for p in problems)
        )
    return DurableSettings.from_dict(dict(raw))


@receiver(setting_changed)
def _reset(*, setting: str, **_: Any) -> None:
    if setting in ("DURABLE", "DATABASES"):
        get_settings.cache_clear()
