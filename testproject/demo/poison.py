"""Handlers that misbehave, for the poison-work tests (in-process and real workers).

Each one that reaches its body writes a line to the file named by ``DURABLE_POISON_LOG``
(when set) before misbehaving: a test counts how many times a poison ran, in which
process, even when the process died with it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from django.db import connection

import durable
from durable.dispatch.context import current_fire
from testproject.demo.models import FireRecord

#: In-process tests release blocked external handlers through these events, by key.
GATES: dict[str, threading.Event] = {}


class Poison(BaseException):
    """An application's own BaseException (not an Exception)."""


def note(what: str) -> None:
    """Append ``what pid attempt`` to ``DURABLE_POISON_LOG``, if set."""
    path = os.environ.get("DURABLE_POISON_LOG")
    if path:
        ctx = current_fire()
        attempt = ctx.attempt if ctx else 0
        with Path(path).open("a") as log:
            log.write(f"{what} {os.getpid()} {attempt}\n")


def _raise(kind: str) -> None:
    note(kind)
    if kind == "SystemExit":
        raise SystemExit(3)
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if kind == "BaseException":
        raise Poison("an application BaseException")
    if kind == "exit":
        os._exit(7)
    if kind == "hang":
        while True:
            time.sleep(1)
    if kind == "DatabaseError":
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table_durable_poison")
    raise AssertionError(f"unknown poison {kind!r}")


@durable.handler(max_attempts=2, backoff=durable.Backoff(base_s=0.05, max_s=0.05))
def atomic_poison(kind: str) -> None:
    """An atomic handler that misbehaves as ``kind`` says, after writing a row."""
    FireRecord.objects.create(key=f"poison:{kind}", fired_at_ms=0)
    _raise(kind)


@durable.handler(
    atomic=False, max_attempts=2, backoff=durable.Backoff(base_s=0.05, max_s=0.05), timeout=2
)
def external_poison(kind: str) -> None:
    """An external handler (2 s timeout) that misbehaves as ``kind`` says."""
    _raise(kind)


@durable.handler(atomic=False, max_attempts=3)
def gated(key: str) -> str:
    """An external handler that waits for ``GATES[key]`` (in-process tests), then records."""
    note(f"gated:{key}")
    gate = GATES.setdefault(key, threading.Event())
    gate.wait(30)
    ctx = current_fire()
    FireRecord.objects.create(key=key, fired_at_ms=ctx.fired_ms if ctx else 0)
    return key


@durable.handler(max_attempts=1, timeout=0.3)
def atomic_sleeper(seconds: float) -> None:
    """An atomic handler that sleeps ``seconds`` (its timeout is 0.3 s)."""
    time.sleep(seconds)


def nap(seconds: float) -> float:
    """An outside step that takes ``seconds``."""
    time.sleep(seconds)
    return seconds


@durable.workflow
def step_with_deadline(ctx, seconds: float) -> str:
    """One outside step with a 0.3 s deadline and one attempt: done, or how it failed."""
    try:
        ctx.options(timeout=0.3, max_attempts=1).step(nap, seconds)
    except durable.exceptions.StepFailed as exc:
        return f"gave up: {exc}"
    return "done"


@durable.workflow
def step_with_default_deadline(ctx, seconds: float) -> str:
    """One outside step, one attempt, no timeout of its own: done, or how it failed."""
    try:
        ctx.options(max_attempts=1).step(nap, seconds)
    except durable.exceptions.StepFailed as exc:
        return f"gave up: {exc}"
    return "done"
