"""A workflow with a checkpointed write, a step, a signal and a sleep."""

from __future__ import annotations

from datetime import timedelta

import durable
from smokeapp.models import Fired


def write(what: str) -> str:
    Fired.objects.create(what=what)
    return what


def measure(word: str) -> int:
    return len(word)


@durable.workflow
def greet(ctx: durable.WorkflowContext, name: str) -> int:
    ctx.atomic(write, f"workflow-started:{name}")
    size = ctx.step(measure, name)
    payload = ctx.wait_for_signal("go", timeout=timedelta(minutes=10))
    ctx.sleep(timedelta(milliseconds=200))
    ctx.atomic(write, f"workflow-done:{payload['word']}")
    return size
