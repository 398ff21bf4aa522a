"""Timer kinds: how the firer turns a timer's ``target`` into something to call.

Plain timers (kind ``handler``) resolve through the handler registry. Other capabilities
(cron occurrences, workflow wake-ups, Celery publishes) register a resolver for their kind
when their module is imported, and the firer dispatches on ``Timer.kind`` without knowing
about them. A resolver returns a :class:`~durable.dispatch.registry.HandlerSpec`; the
firer calls ``spec.fn(*timer.args, **timer.kwargs)``, inside the batch transaction when
``spec.atomic``.
"""

from __future__ import annotations

from collections.abc import Callable

from durable.dispatch.registry import HandlerSpec, handlers

Resolver = Callable[[str], HandlerSpec]

_resolvers: dict[str, Resolver] = {"handler": handlers.resolve}


def register_kind(kind: str, resolver: Resolver) -> None:
    """Make timers of ``kind`` fire through ``resolver`` (called once per fire)."""
    _resolvers[kind] = resolver


def resolvers() -> dict[str, Resolver]:
    """Return a copy of the kind → resolver table."""
    return dict(_resolvers)
