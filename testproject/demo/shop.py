"""The outside world of the demo shop: a payment gateway and a mailer, both pretend.

Each call leaves a ``FireRecord`` row (in its own transaction, like a call to a real
service would leave a trace there), so tests can count how often a step really ran.
Like real gateways, they take an idempotency key: a charge retried with the same key
is not taken twice.
"""

from __future__ import annotations


def _record(key: str) -> bool:
    # Imported here, not at the top: the demo's models module imports this one.
    from testproject.demo.models import FireRecord

    _, created = FireRecord.objects.get_or_create(key=key, defaults={"fired_at_ms": 0})
    return created


def charge(order_id: int, amount_cents: int, idempotency_key: str) -> str:
    """Charge the customer; return the payment reference (idempotent per key)."""
    _record(f"charge:{order_id}:{idempotency_key}")
    return f"pay-{order_id}-{amount_cents}"


def refund(payment_ref: str) -> None:
    """Give the money back."""
    _record(f"refund:{payment_ref}")


def ask_for_review(order_id: int) -> None:
    """E-mail the customer asking for a review."""
    _record(f"review-mail:{order_id}")
