"""durable's models: the rows that make timers and shard ownership durable.

Every row is written with the ORM in the caller's transaction (DESIGN §4): scheduling in
a transaction that rolls back leaves nothing behind. Times the worker computes with are
integer UTC epoch milliseconds (``*_ms``); timestamps meant for people are datetimes.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from durable import limits

# The choices and the queryset live beside the models; importing them here keeps
# ``durable.models.TimerState`` and the rest where code and docs expect them.
from durable.choices import TimerKind, TimerState, WorkflowState
from durable.fields import clock_stamp as _stamp
from durable.indexes import lookup_indexes, unique_key

# In a module of its own (this one stays under the size limit); re-exported here.
from durable.limits import ConcurrencyKey as ConcurrencyKey
from durable.querysets import WorkflowRunQuerySet


def _parent_field() -> models.ForeignKey:
    """A nullable link to a parent row of the same model.

    Indexed only where set (a partial index in the model's Meta): most rows have no
    parent, and every index entry is paid again at each state change of the row.
    """
    return models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="children",
        db_index=False,
    )


class Timer(models.Model):
    """One durable timer: fire ``target`` with ``args``/``kwargs`` at ``fire_at_ms``.

    ``shard`` routes it to the worker that owns that shard; ``bucket`` (``fire_at_ms >>
    BUCKET_SHIFT``) lets the worker load just the near-term part of a shard, so the
    database is the timing wheel's coarsest level.
    """

    shard = models.PositiveSmallIntegerField()
    bucket = models.BigIntegerField()
    fire_at_ms = models.BigIntegerField(help_text="when to fire, UTC epoch milliseconds")
    state = models.CharField(max_length=10, choices=TimerState.choices, default=TimerState.PENDING)
    kind = models.CharField(max_length=10, choices=TimerKind.choices, default=TimerKind.HANDLER)
    target = models.CharField(max_length=255, help_text="handler dotted name or task name")
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    # NULL, not "", for no key: unique where set (``durable.indexes.unique_key``).
    key = models.CharField(max_length=255, null=True, blank=True, help_text="idempotency key")  # noqa: DJ001
    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=5)
    backoff_base_s = models.FloatField(default=1.0)
    backoff_max_s = models.FloatField(default=3600.0)
    parent = _parent_field()
    on_complete = models.CharField(max_length=255, blank=True, default="")
    context = models.JSONField(null=True, blank=True)
    result = models.JSONField(null=True, blank=True)
    fired_token = models.BigIntegerField(
        null=True, blank=True, help_text="lease token of the transaction that fired it"
    )
    claim_expires_ms = models.BigIntegerField(null=True, blank=True)
    claim_token = models.BigIntegerField(
        null=True, blank=True, help_text="lease token of the owner that claimed it (state firing)"
    )
    last_error = models.CharField(max_length=500, blank=True, default="")
    debounce_since_ms = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="debounced timer: when its burst's first call came (epoch ms); "
        "max_wait counts from it",
    )
    created_at = _stamp()
    updated_at = _stamp()
    fired_at = models.DateTimeField(null=True, blank=True)
    concurrency_key = limits.concurrency_key_field()
    queued_ms = limits.queued_ms_field()

    class Meta:
        indexes = [
            *limits.concurrency_indexes(),  # a key's running timers, and its line
            models.Index(
                fields=["parent"],
                name="durable_timer_parent_idx",
                condition=Q(parent__isnull=False),
            ),
            # The loader and the rescan: pending rows of one shard by bucket, then fire time.
            models.Index(
                fields=["shard", "bucket", "fire_at_ms"],
                name="durable_timer_pending_idx",
                condition=Q(state="pending"),
            ),
            # Reclaiming external fires whose claim expired.
            models.Index(
                fields=["shard", "claim_expires_ms"],
                name="durable_timer_firing_idx",
                condition=Q(state="firing"),
            ),
            # Retention pruning of finished rows, oldest first.
            models.Index(
                fields=["updated_at"],
                name="durable_timer_done_idx",
                condition=Q(state__in=["fired", "canceled"]),
            ),
            *lookup_indexes(),  # states but fired by fire time; key prefixes
        ]
        constraints = [unique_key()]

    def __str__(self) -> str:
        return f"Timer {self.pk} {self.target} @ {self.fire_at_ms} ({self.state})"


class ShardLease(models.Model):
    """Who owns a shard, until when, and the fencing token of that ownership.

    ``token`` increases at every change of owner. Every transaction that fires a timer
    locks this row and checks the token, so a worker that lost the lease (paused, cut
    off, slow) cannot commit a fire after another worker took over.
    """

    shard = models.PositiveSmallIntegerField(primary_key=True)
    owner = models.CharField(max_length=200, blank=True, default="")
    token = models.BigIntegerField(default=0)
    expires_at = models.DateTimeField(null=True, blank=True)
    cursor_ms = models.BigIntegerField(
        default=0, help_text="everything due up to this instant has been fired"
    )
    updated_at = _stamp()
    raft_term = models.BigIntegerField(
        default=0, help_text="Raft term of the leader that took it (0: taken by lease rules)"
    )

    def __str__(self) -> str:
        return f"shard {self.shard} → {self.owner or '(free)'} #{self.token}"


class WorkerNode(models.Model):
    """A running (or recently stopped) ``run_timer_shards`` process."""

    name = models.CharField(max_length=200, unique=True)
    host = models.CharField(max_length=255, blank=True, default="")
    pid = models.PositiveIntegerField(null=True, blank=True)
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField(db_index=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    shards = models.JSONField(default=list, blank=True, help_text="shards held")
    raft = models.JSONField(
        default=dict, blank=True, help_text="per shard: Raft role, term, leader (Raft on)"
    )

    def __str__(self) -> str:
        return self.name


class CronSchedule(models.Model):
    """A cron or interval schedule: its calendar, policies, chain state and last run.

    The schedule itself never polls: each occurrence is a ``Timer`` (kind ``cron``, key
    ``cron:<name>:<epoch_ms>``), and firing one locks this row, runs the handler, records
    the run and inserts the next occurrence's timer in the same transaction. ``next_ms``
    names the occurrence whose timer is live; a timer for any other occurrence is stale
    and fires as a no-op, so the chain can neither break nor fork.
    """

    class Kind(models.TextChoices):
        """What the schedule's calendar is."""

        CRON = "cron", "cron expression"
        INTERVAL = "interval", "fixed interval"

    class CatchUp(models.TextChoices):
        """What happens to occurrences missed while no worker ran them."""

        SKIP = "skip", "skip missed occurrences"
        FIRE_ONCE = "fire_once", "run the latest missed once"
        FIRE_ALL = "fire_all", "run every missed one (at most 1000)"

    class Overlap(models.TextChoices):
        """What happens to occurrences due while a run is running."""

        SKIP = "skip", "skip while running"
        QUEUE = "queue", "queue one run"

    class Source(models.TextChoices):
        """Where the schedule was declared."""

        CODE = "code", "@durable.cron / @durable.every"
        SETTINGS = "settings", 'DURABLE["CRONS"]'
        API = "api", "durable.schedules.create()"

    class Status(models.TextChoices):
        """Outcome of the last run."""

        NONE = "", "never ran"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        INTERRUPTED = "interrupted", "interrupted (worker died)"

    name = models.CharField(max_length=200, unique=True)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    expression = models.CharField(max_length=200, blank=True, default="")
    interval_ms = models.BigIntegerField(null=True, blank=True)
    anchor_ms = models.BigIntegerField(default=0, help_text="interval phase, epoch ms")
    timezone = models.CharField(max_length=64, default="UTC")
    catch_up = models.CharField(max_length=10, choices=CatchUp.choices, default=CatchUp.FIRE_ONCE)
    overlap = models.CharField(max_length=10, choices=Overlap.choices, default=Overlap.SKIP)
    grace_ms = models.BigIntegerField(default=60_000)
    handler = models.CharField(max_length=255, help_text="dotted path of the function run")
    atomic = models.BooleanField(default=True)
    kwargs = models.JSONField(
        default=dict, blank=True, help_text="keyword arguments passed to the function at each run"
    )
    enabled = models.BooleanField(default=True)
    source = models.CharField(max_length=10, choices=Source.choices, default=Source.API)
    declaration = models.JSONField(
        null=True, blank=True, help_text="the code/settings declaration last synced"
    )
    next_ms = models.BigIntegerField(null=True, blank=True)
    next_at = models.DateTimeField(null=True, blank=True)
    running = models.JSONField(
        null=True, blank=True, help_text="the run of an atomic=False handler in progress"
    )
    running_until_ms = models.BigIntegerField(null=True, blank=True)
    busy_since_ms = models.BigIntegerField(null=True, blank=True)
    last_scheduled_ms = models.BigIntegerField(null=True, blank=True)
    last_started_ms = models.BigIntegerField(null=True, blank=True)
    last_run_at = models.DateTimeField(null=True, blank=True)
    last_status = models.CharField(
        max_length=12, choices=Status.choices, blank=True, default=Status.NONE
    )
    last_duration_ms = models.BigIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    fired_count = models.PositiveBigIntegerField(default=0)
    failed_count = models.PositiveBigIntegerField(default=0)
    skipped_count = models.PositiveBigIntegerField(default=0)
    created_at = _stamp()
    updated_at = _stamp()

    class Meta:
        indexes = [
            models.Index(fields=["enabled", "name"], name="durable_cron_enabled_idx"),
            models.Index(fields=["last_status"], name="durable_cron_status_idx"),
        ]
        constraints = [
            models.CheckConstraint(
                condition=(Q(kind="cron") & ~Q(expression=""))
                | (Q(kind="interval") & Q(interval_ms__gte=1000)),
                name="durable_cron_spec_ck",
            )
        ]

    def __str__(self) -> str:
        spec = self.expression if self.kind == self.Kind.CRON else f"every {self.interval_ms} ms"
        return f"{self.name} ({spec}, {self.timezone})"


class WorkflowRun(models.Model):
    """One execution of a workflow: its arguments, state, result and bound row.

    The id is the run id (given to ``start(run_id=...)`` or generated). Every timer of a
    run is routed to ``shard`` (``shard_for`` of its ``concurrency_key`` if set, else of
    its id), so one worker at a time replays it.
    A run started from a model method stores that row's model label and primary key.
    """

    ACTIVE_STATES = ("pending", "running", "sleeping", "waiting")

    id = models.CharField(primary_key=True, max_length=100)
    name = models.CharField(max_length=255, help_text="the workflow's registered name")
    state = models.CharField(
        max_length=10, choices=WorkflowState.choices, default=WorkflowState.PENDING
    )
    shard = models.PositiveSmallIntegerField()
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    model_label = models.CharField(
        max_length=100, blank=True, default="", help_text="bound row's model (app_label.model)"
    )
    object_pk = models.CharField(max_length=100, blank=True, default="")
    parent = _parent_field()
    result = models.JSONField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True, default="")
    wait_signal = models.CharField(
        max_length=200, blank=True, default="", help_text="signal awaited while waiting"
    )
    wait_seq = models.IntegerField(null=True, blank=True)
    replays = models.PositiveIntegerField(default=0)
    retries = models.PositiveIntegerField(default=0)
    created_at = _stamp()
    updated_at = _stamp()
    finished_at = models.DateTimeField(null=True, blank=True)
    concurrency_key = limits.run_key_field()

    objects = WorkflowRunQuerySet.as_manager()

    class Meta:
        indexes = [
            models.Index(fields=["state", "name"], name="durable_wfrun_state_idx"),
            models.Index(
                fields=["parent"],
                name="durable_wfrun_parent_idx",
                condition=Q(parent__isnull=False),
            ),
            models.Index(fields=["name", "created_at"], name="durable_wfrun_name_idx"),
            models.Index(fields=["created_at"], name="durable_wfrun_created_idx"),
            models.Index(fields=["model_label", "object_pk"], name="durable_wfrun_object_idx"),
            # Retention pruning: finished top-level runs (each with its tree), oldest first.
            models.Index(
                fields=["finished_at"],
                name="durable_wfrun_done_idx",
                condition=Q(state__in=["completed", "failed", "canceled"], parent__isnull=True),
            ),
            *limits.run_key_indexes(),
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.id} ({self.state})"

    @property
    def finished(self) -> bool:
        """True once the run completed, failed or was cancelled."""
        return self.state not in self.ACTIVE_STATES


class WorkflowStep(models.Model):
    """One recorded ctx call of a run, at sequence number ``seq``: the replay history.

    ``kind`` and ``name`` are what replay checks for determinism; ``result`` is returned
    on replay instead of running the call again. ``status`` is ``done``, ``failed`` (a
    step out of attempts), ``retrying`` (a failed attempt, retry due at ``wake_ms``) or
    ``waiting`` (a sleep, signal or child not finished; ``wake_ms`` is its deadline).
    A ``step`` or ``atomic`` call also records when it began (``started_at``, kept
    across retries) and how long its latest attempt ran (``duration_ms``); the record is
    written when an attempt ends, so ``created_at`` is the end of the first attempt and
    ``updated_at`` the end of the latest.
    """

    # No index of its own: the (run, seq) unique constraint serves every lookup by run,
    # and each step insert (the hot path) maintains one index fewer.
    run = models.ForeignKey(
        WorkflowRun, on_delete=models.CASCADE, related_name="steps", db_index=False
    )
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=12)
    name = models.CharField(max_length=255)
    status = models.CharField(max_length=10)
    result = models.JSONField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True, default="")
    attempts = models.PositiveIntegerField(default=0)
    wake_ms = models.BigIntegerField(null=True, blank=True)
    started_at = models.DateTimeField(
        null=True, blank=True, help_text="when a step began (its first attempt; steps only)"
    )
    duration_ms = models.PositiveIntegerField(
        null=True, blank=True, help_text="how long the step's latest attempt ran, ms"
    )
    created_at = _stamp()
    updated_at = _stamp()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="durable_wfstep_run_seq_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.kind} {self.name} ({self.status})"


class WorkflowSignal(models.Model):
    """A signal sent to a run; kept until a ``ctx.wait_for_signal`` consumes it."""

    run = models.ForeignKey(WorkflowRun, on_delete=models.CASCADE, related_name="signals")
    name = models.CharField(max_length=200)
    payload = models.JSONField(null=True, blank=True)
    created_at = _stamp()
    consumed_at = models.DateTimeField(null=True, blank=True)
    consumed_seq = models.IntegerField(null=True, blank=True)

    class Meta:
        indexes = [
            # The replay's lookup: the oldest unconsumed signal of that name for the run.
            models.Index(
                fields=["run", "name", "id"],
                name="durable_wfsignal_open_idx",
                condition=Q(consumed_at__isnull=True),
            ),
            models.Index(fields=["name", "created_at"], name="durable_wfsignal_name_idx"),
        ]

    def __str__(self) -> str:
        return f"signal {self.name} → {self.run_id}"
