"""The row that holds one concurrency key (its lock, limits, rate log), and ``Timer``'s
concurrency columns and indexes (kept here so ``durable/models.py`` stays small).

Admission to a key (:mod:`durable.storage.concurrency`) locks this row, so two
transactions never decide about the same key at once: out-of-order commits cannot admit
more than the limit. The row is created on first use and never deleted (a key is a few
bytes; deleting it would race with the next admission's insert).
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from durable.fields import clock_stamp


class ConcurrencyKey(models.Model):
    """One concurrency key of a handler: ``"<handler dotted name>:<key>"``."""

    name = models.CharField(max_length=255, primary_key=True)
    max_concurrency = models.PositiveIntegerField(
        null=True, blank=True, help_text="its handler's max_concurrency when last admitted to"
    )
    rate_limit = models.CharField(
        max_length=20, blank=True, default="", help_text="its handler's rate_limit ('' none)"
    )
    recent = models.JSONField(
        default=list, blank=True, help_text="epoch ms of its last starts (the rate's window)"
    )
    updated_at = clock_stamp()  # the injected clock's, not the wall clock's

    class Meta:
        app_label = "durable"

    def __str__(self) -> str:
        return self.name


def concurrency_indexes() -> list[models.Index]:
    """``Timer``'s indexes for concurrency keys (:mod:`durable.storage.concurrency`).

    A key's running timers (``state`` firing), and its line: parked at ``PARKED_MS`` or
    woken and not started yet, in order of ``queued_ms``. Both partial: a timer without a
    key, or out of line, costs them nothing.
    """
    return [
        models.Index(
            fields=["concurrency_key", "state"],
            name="durable_timer_conc_idx",
            condition=Q(concurrency_key__isnull=False),
        ),
        models.Index(
            fields=["concurrency_key", "fire_at_ms", "queued_ms", "id"],
            name="durable_timer_line_idx",
            condition=Q(state="pending", queued_ms__isnull=False),
        ),
    ]


def concurrency_key_field() -> models.CharField:
    """``Timer.concurrency_key``: its handler's key, ``"<handler>:<key>"``.

    NULL (not ``""``) for "no key": the partial indexes then hold only keyed rows.
    """
    return models.CharField(
        max_length=255, null=True, blank=True, help_text="its handler's concurrency key"
    )


def queued_ms_field() -> models.BigIntegerField:
    """``Timer.queued_ms``: set while the timer waits in its key's line (its place)."""
    return models.BigIntegerField(
        null=True, blank=True, help_text="in line for a concurrency slot: its place (due time)"
    )


def run_key_field() -> models.CharField:
    """``WorkflowRun.concurrency_key``: its workflow's key, ``"workflow:<name>:<key>"``.

    NULL for a run of a workflow without limits. While the run is running, sleeping or
    waiting it holds a slot of that key (:mod:`durable.storage.run_slots`).
    """
    return models.CharField(
        max_length=255, null=True, blank=True, help_text="its workflow's concurrency key"
    )


def run_key_indexes() -> list[models.Index]:
    """``WorkflowRun``'s index for concurrency keys: a key's runs by state (partial: a run
    without a key costs it nothing)."""
    return [
        models.Index(
            fields=["concurrency_key", "state"],
            name="durable_wfrun_conc_idx",
            condition=Q(concurrency_key__isnull=False),
        ),
    ]
