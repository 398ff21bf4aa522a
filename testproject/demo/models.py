"""The demo's models: rows handlers write (to count effects) and the tutorial's Order."""

from datetime import timedelta

from django.db import models

import durable
from durable.exceptions import SignalTimeout
from durable.workflows import WorkflowContext
from testproject.demo import shop


class FireRecord(models.Model):
    """One row per handler execution: counting rows per key proves exactly-once."""

    key = models.CharField(max_length=200, db_index=True)
    fired_at_ms = models.BigIntegerField()
    due_at_ms = models.BigIntegerField(null=True)

    def __str__(self) -> str:
        return f"{self.key} @ {self.fired_at_ms}"


class Order(models.Model):
    """A shop order; :meth:`fulfil` is the durable workflow of the tutorial."""

    class Status(models.TextChoices):
        NEW = "new"
        RESERVED = "reserved"
        PAID = "paid"
        SHIPPED = "shipped"
        DONE = "done"
        CANCELED = "canceled"

    customer = models.CharField(max_length=100)
    total_cents = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.NEW)
    payment_ref = models.CharField(max_length=100, blank=True, default="")
    tracking = models.CharField(max_length=100, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk} ({self.status})"

    @durable.workflow
    def fulfil(self, ctx: WorkflowContext) -> str:
        """Reserve, charge, wait up to 3 days for shipping, then ask for a review."""
        ctx.atomic(self.set_status, self.Status.RESERVED)
        payment = ctx.step(shop.charge, self.pk, self.total_cents, ctx.idempotency_key)
        ctx.atomic(self.set_status, self.Status.PAID, payment_ref=payment)
        try:
            shipped = ctx.wait_for_signal("shipped", timeout=timedelta(days=3))
        except SignalTimeout:
            ctx.step(shop.refund, payment)
            ctx.atomic(self.set_status, self.Status.CANCELED)
            return "canceled"
        ctx.atomic(self.set_status, self.Status.SHIPPED, tracking=shipped["tracking"])
        ctx.sleep(timedelta(days=14))
        ctx.step(shop.ask_for_review, self.pk)
        ctx.atomic(self.set_status, self.Status.DONE)
        return "done"

    def set_status(self, status: str, **fields: str) -> str:
        """Move the order to ``status`` (run inside ``ctx.atomic``: exactly once)."""
        type(self).objects.filter(pk=self.pk).update(status=status, **fields)
        return status
