"""The handler registry: ``@durable.handler`` functions, by dotted name.

A handler's name is ``"<module>.<qualname>"``; that string is what a ``Timer`` stores in
``target``. The decorator registers the function when its module is imported, and the
worker imports the modules that hold handlers once, at start-up
(:mod:`durable.discovery`). At fire time a name is only looked up, never imported: a
row's target is data, and importing whatever it names would let a row run any module's
import-time code (``unittest.__main__`` runs a test CLI and exits). A name that is not
registered raises :class:`~durable.exceptions.UnknownHandler`, which fails that timer
(retried, then dead-lettered), not the worker.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from durable.core.backoff import Backoff
from durable.dispatch.concurrency import ConcurrencyPolicy
from durable.dispatch.giveup import final
from durable.exceptions import GiveUp, HandlerAborted, UnknownHandler


@dataclass(frozen=True, slots=True, kw_only=True)
class HandlerSpec:
    """A registered handler and its firing policy."""

    name: str
    fn: Callable[..., Any]
    atomic: bool = True
    """Run inside the transaction that marks the timer fired (exactly-once DB effect)."""
    max_attempts: int | None = None
    """Attempts before dead letter; ``None`` uses ``DURABLE["MAX_ATTEMPTS"]``."""
    backoff: Backoff | None = None
    """Retry policy; ``None`` uses the ``BACKOFF_*`` settings."""
    timeout: float | None = None
    """Seconds an attempt may run before it is abandoned as failed; ``None`` uses
    ``DURABLE["ATOMIC_TIMEOUT_S"]`` (atomic) or ``DURABLE["HANDLER_TIMEOUT_S"]``;
    ``math.inf`` sets no deadline."""
    retry_on: tuple[type[Exception], ...] = ()
    """Only these exceptions are retried; any other is final (empty: all are retried)."""
    give_up_on: tuple[type[Exception], ...] = ()
    """These exceptions are final (dead letter at once); see :mod:`durable.dispatch.giveup`."""
    concurrency: ConcurrencyPolicy | None = None
    """At most ``max_concurrency`` attempts per key at once; ``None``: no limit."""

    def failure(self, exc: BaseException) -> BaseException:
        """What an attempt that raised ``exc`` is recorded as: contained (a
        ``BaseException`` becomes ``HandlerAborted``), and marked final when ``GiveUp`` or
        the ``retry_on``/``give_up_on`` policy says so."""
        return final(HandlerAborted.contain(exc), self.retry_on, self.give_up_on)


def handler_name(fn: Callable[..., Any]) -> str:
    """Return the dotted name a function is registered and stored under."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname:
        raise TypeError(f"{fn!r} has no __module__/__qualname__; handlers must be functions")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"handler {qualname!r} is not importable by name: define handlers at module level"
        )
    return f"{module}.{qualname}"


#: What an unknown name's error says to do about it.
WHERE_TO_REGISTER = (
    "is its module an installed app's handlers.py (or workflows.py, crons.py, tasks.py), "
    "or listed in DURABLE['IMPORTS']?"
)


class HandlerRegistry:
    """Dotted name → :class:`HandlerSpec`. Thread-safe; looking up never imports."""

    def __init__(self) -> None:
        self._specs: dict[str, HandlerSpec] = {}
        self._lock = threading.Lock()

    def register(self, spec: HandlerSpec) -> HandlerSpec:
        """Add ``spec``; registering the same function again replaces its policy."""
        with self._lock:
            self._specs[spec.name] = spec
        return spec

    def get(self, name: str) -> HandlerSpec | None:
        """Return the spec registered under ``name``, or ``None`` (no import attempted)."""
        return self._specs.get(name)

    def resolve(self, name: str) -> HandlerSpec:
        """Return the spec registered under ``name``; nothing is imported.

        Raises :class:`UnknownHandler` naming the handler when none is registered.
        """
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownHandler(
                f"unknown handler {name!r}: it is not registered (no @durable.handler "
                f"function of that name was imported in this process); {WHERE_TO_REGISTER}",
                handler=name,
            )
        return spec

    def names(self) -> list[str]:
        """Return every registered name, sorted."""
        return sorted(self._specs)


def check_stored_call(args: Any, kwargs: Any) -> None:
    """Raise :class:`~durable.exceptions.GiveUp` unless a row's ``args`` is a list and its
    ``kwargs`` a dict, as ``schedule()`` writes them.

    A row written another way (raw SQL, an old version) could otherwise call the handler
    with the characters of a string as its arguments. The worker calls this before the
    handler and fails the timer for good on it (no retry would fix the row), without
    calling the handler.
    """
    for name, value, kind, words in (
        ("args", args, list, "an array"),
        ("kwargs", kwargs, dict, "an object"),
    ):
        if not isinstance(value, kind):
            raise GiveUp(
                f"the timer's stored {name} is a JSON {type(value).__name__} ({value!r:.50}), "
                f"not {words}: the row was not written by durable.schedule(); the handler "
                "was not called"
            )


#: The process-wide registry the ``@durable.handler`` decorator writes to. Like Django's
#: ``admin.site``, it is filled by decorators at import time; the worker reads it.
handlers = HandlerRegistry()
