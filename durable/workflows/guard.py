"""Strict mode: wall-clock time and randomness raise inside workflow code.

Workflow code must take time and randomness from ``ctx.now()``, ``ctx.random()`` and
``ctx.uuid4()``, which are recorded and replay identically. Strict mode catches the
usual slips: ``time.time()``/``time.time_ns()``, ``datetime.now()``/``utcnow()``/
``date.today()`` (so ``django.utils.timezone.now()`` too), the ``random`` module's
functions, ``uuid.uuid1()``/``uuid4()`` and ``os.urandom()``.

How: while workflow code runs (never while a step, ``ctx.atomic`` function or durable's
own code runs) a profile hook is installed on the replaying thread with
``sys.setprofile``. It sees every call, however the function was imported
(``from time import time`` included), and only on that thread, so other threads and
other requests run untouched. Python removes a profile hook that raises; the guard
re-arms itself at the next ctx call, and the violation is remembered by the context,
so the run fails even if the workflow code swallowed the error. A profiler installed
with ``sys.setprofile`` (cProfile) is suspended while workflow code runs in strict mode.
"""

from __future__ import annotations

import datetime as _dt
import os
import random
import sys
import time
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Any

from durable.exceptions import NonDeterminismError

_DATE_METHODS = frozenset({"now", "utcnow", "today"})
_TIME_FUNCTIONS = frozenset({"time", "time_ns"})
_FORBIDDEN_CODE = {uuid.uuid4.__code__: "uuid.uuid4()", uuid.uuid1.__code__: "uuid.uuid1()"}
_RANDOM = random._inst  # type: ignore[attr-defined]  # the instance behind random.random() & co.
_ADVICE = {
    "time": "use ctx.now()",
    "datetime": "use ctx.now()",
    "random": "use ctx.random() (or a random.Random seeded from it)",
    "uuid": "use ctx.uuid4()",
    "os.urandom": "use ctx.uuid4() or ctx.random()",
}


def forbidden_call(frame: FrameType, event: str, arg: Any) -> str | None:
    """Name the non-deterministic call this profile event is, or ``None``."""
    if event == "c_call":
        owner = getattr(arg, "__self__", None)
        name = getattr(arg, "__name__", "")
        if owner is time and name in _TIME_FUNCTIONS:
            return f"time.{name}()"
        if isinstance(owner, type) and issubclass(owner, _dt.date) and name in _DATE_METHODS:
            return f"{owner.__name__}.{name}()"
        if owner is _RANDOM:
            return f"random.{name}()"
        if owner is os and name == "urandom":
            return "os.urandom()"
    elif event == "call":
        return _FORBIDDEN_CODE.get(frame.f_code)
    return None


def _advice(call: str) -> str:
    for prefix, text in _ADVICE.items():
        if call.startswith(prefix):
            return text
    return "use ctx.now(), ctx.random() or ctx.uuid4()"


class StrictGuard:
    """Arms the profile hook on this thread while workflow code runs.

    ``on_violation`` receives the error before it is raised into the workflow code;
    the context keeps it, so swallowing the error does not save the run.
    """

    def __init__(self, on_violation: Callable[[NonDeterminismError], None]) -> None:
        self._on_violation = on_violation
        self._previous: Any = None
        self._armed = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        call = forbidden_call(frame, event, arg)
        if call is None:
            return
        self._armed = False  # Python unsets a profile hook that raises
        error = NonDeterminismError(
            f"strict mode: {call} is not deterministic in workflow code; {_advice(call)}",
            call=call,
        )
        self._on_violation(error)
        raise error

    def arm(self) -> None:
        """Start watching this thread's calls (entering workflow code)."""
        if not self._armed:
            self._previous = sys.getprofile()
            self._armed = True
            sys.setprofile(self._profile)

    def disarm(self) -> None:
        """Stop watching (leaving workflow code, for a ctx call or for good)."""
        if self._armed:
            self._armed = False
            sys.setprofile(self._previous)
        elif sys.getprofile() is None and self._previous is not None:
            sys.setprofile(self._previous)  # the hook was dropped by a violation
