"""Indexes of ``Timer`` that serve its readers (the admin, status, retention), not the worker.

Each index a row version enters costs a write per fire: marking a timer fired is the
one write every fire makes and it is never a HOT update (it changes ``state``), so it
inserts into every index whose predicate the fired version matches. These indexes
leave fired rows out, and keyless rows; what they cost per fire, and the queries each
serves, are in docs/benchmarks.md (issue 16).
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from durable.choices import UNFIRED_STATES


def lookup_indexes() -> list[models.Index]:
    """``Timer``'s indexes by state (all but fired) and fire time, and by key prefix.

    - ``durable_timer_unfired_idx``: a state's rows in fire-time order: the admin's
      state and due filters and their sort, the dead letters' count and latest
      (:mod:`durable.storage.admin_queries`), time travel. Fired rows, the bulk of the
      table, are read by when they finished (``durable_timer_done_idx``) or by id.
    - ``durable_timer_key_prefix_idx``: ``LIKE 'prefix%'`` on keys (the admin's key
      search, retention of a run's wake-ups ``wf:<run id>:``) on PostgreSQL, where the
      unique index's collation order cannot serve ``LIKE``. It replaces the
      ``varchar_pattern_ops`` twin Django made beside the unique ``CharField`` the key
      was, which held an entry for every row version, keyless or not (migration 0016).
    """
    return [
        models.Index(
            fields=["state", "fire_at_ms"],
            name="durable_timer_unfired_idx",
            condition=Q(state__in=UNFIRED_STATES),
        ),
        models.Index(
            fields=["key"],
            name="durable_timer_key_prefix_idx",
            opclasses=["varchar_pattern_ops"],
            condition=Q(key__isnull=False),
        ),
    ]


def unique_key() -> models.UniqueConstraint:
    """``Timer.key`` is unique where set: a unique index of the rows that have a key.

    The same guarantee as a unique column (NULL keys never conflicted), without an
    entry per keyless row version: a column's ``UNIQUE`` indexes NULLs too, and most
    timers have no key (migration 0017).
    """
    return models.UniqueConstraint(
        fields=["key"], name="durable_timer_key_uniq", condition=Q(key__isnull=False)
    )
