"""The demo's handlers: each prints what fired, when it was due and how late it ran."""

from __future__ import annotations

import time
from datetime import timedelta

import durable
from durable.dispatch.context import current_fire
from testproject.demo.models import FireRecord


def _say(what: str) -> None:
    ctx = current_fire()
    now_ms = time.time_ns() // 1_000_000
    late = f"{now_ms - ctx.scheduled_ms:>5} ms late" if ctx else ""
    attempt = f" (attempt {ctx.attempt})" if ctx and ctx.attempt > 1 else ""
    print(f"  fired  {what:<38} {late}{attempt}", flush=True)


@durable.handler
def remind(name: str) -> str:
    """An atomic reminder: its row and the timer's 'fired' commit together."""
    FireRecord.objects.create(key=f"remind:{name}", fired_at_ms=time.time_ns() // 1_000_000)
    _say(f"reminder for {name}")
    return name


@durable.handler(max_attempts=3, backoff=durable.Backoff(base_s=0.5, max_s=2.0))
def flaky(name: str) -> None:
    """Fails on its first attempt, to show retries with backoff."""
    ctx = current_fire()
    if ctx is not None and ctx.attempt == 1:
        _say(f"flaky {name}: failing on purpose")
        raise RuntimeError("first attempt fails on purpose")
    _say(f"flaky {name}: succeeded")


@durable.handler(atomic=False)
def notify_outside(name: str) -> None:
    """An external (at-least-once) handler, run on the worker's executor."""
    _say(f"external call for {name}")


@durable.handler
def after(timer_id: int, context: object, result: dict) -> None:
    """An on_complete follow-up."""
    _say(f"on_complete of #{timer_id}: {result['status']}")


@durable.handler  # registered: the demo creates its schedule at run time
def heartbeat(occurrence: durable.Occurrence) -> None:
    """An interval schedule's function: once per occurrence, however many workers run."""
    late = int(time.time() * 1000) - occurrence.scheduled_ms
    flag = " (catch-up)" if occurrence.catch_up else ""
    print(
        f"  cron   {occurrence.schedule} at {occurrence.scheduled_at:%H:%M:%S}{flag:<14}"
        f"{late:>5} ms late",
        flush=True,
    )


def announce(text: str) -> str:
    """A workflow step with an outside effect (printing): at least once, recorded."""
    print(f"  step   {text}", flush=True)
    return text


@durable.workflow
def welcome(ctx: durable.WorkflowContext, name: str) -> str:
    """A small workflow: a step, a durable 2 s sleep (no thread held), another step."""
    ctx.step(announce, f"welcome {name}: first step")
    ctx.sleep(timedelta(seconds=2))
    ctx.step(announce, f"welcome {name}: after a durable 2 s sleep")
    return name
