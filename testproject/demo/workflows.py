"""Demo workflows: the onboarding flow of the how-to guide and the benchmark's ten steps.

Their recorded histories live in ``tests/histories/``: changing the order of their ctx
calls without ``ctx.patched`` fails the golden replay tests.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import durable
from durable.exceptions import SignalTimeout
from durable.workflows import WorkflowContext


def send_mail(email: str, template: str) -> str:
    """Pretend to send an e-mail; leaves a ``FireRecord`` (an outside effect)."""
    from testproject.demo.models import FireRecord  # the models module imports durable

    FireRecord.objects.create(key=f"mail:{email}:{template}", fired_at_ms=0)
    return template


def send_sms(email: str) -> str:
    """Pretend to send a text message."""
    from testproject.demo.models import FireRecord

    FireRecord.objects.create(key=f"sms:{email}", fired_at_ms=0)
    return "sent"


@durable.workflow
def onboarding(ctx: WorkflowContext, email: str) -> dict[str, Any]:
    """Welcome a user, send tips a day later, and wait a week for their first order."""
    ctx.step(send_mail, email, "welcome")
    if ctx.patched("welcome-sms"):  # added in v2: runs started before it skip the SMS
        ctx.step(send_sms, email)
    joined = ctx.now()
    ctx.sleep(timedelta(days=1))
    ctx.step(send_mail, email, "tips")
    try:
        order = ctx.wait_for_signal("first-order", timeout=timedelta(days=7))
    except SignalTimeout:
        ctx.step(send_mail, email, "we-miss-you")
        return {"joined": joined.isoformat(), "ordered": False}
    return {"joined": joined.isoformat(), "ordered": True, "order": order}


def increment(value: int) -> int:
    """One cheap step of the benchmark."""
    return value + 1


@durable.workflow
def ten_steps(ctx: WorkflowContext, start: int = 0) -> int:
    """Ten sequential steps: the benchmark's unit of work."""
    value = start
    for _ in range(10):
        value = ctx.step(increment, value)
    return value


@durable.workflow
def no_steps(ctx: WorkflowContext, start: int = 0) -> int:
    """No step at all: the benchmark's baseline for the cost of one step."""
    return start


@durable.workflow
def nap_until(ctx: WorkflowContext, wake_ms: int) -> int:
    """Sleep until ``wake_ms`` (epoch ms), then finish: the benchmark's sleeper."""
    ctx.sleep_until(datetime.fromtimestamp(wake_ms / 1000, tz=UTC))
    return wake_ms
