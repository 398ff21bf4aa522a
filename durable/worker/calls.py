"""How the firer calls a batch's handlers: looked up once per batch, called cheaply.

At a drain of thousands of due timers a second, what the fire loop does per timer in
Python is a third of a fire's cost (docs/benchmarks.md, issue 16). So per batch, not
per timer: each ``(kind, target)`` is resolved once, with its time limit
(:meth:`BatchCalls.lookup`), and ``SIGALRM`` is taken once (:meth:`Deadlines.batch
<durable.worker.deadline.Deadlines.batch>`). Per timer only what must be: a row with no
arguments (the stored ``[]`` and ``{}``, what most timers carry) is called without
decoding them, and the fire context and the deadline are set without context managers.
The guarantees are the ones before: every atomic handler runs under its own deadline
and sees its own :class:`~durable.dispatch.context.FireContext`; a row whose stored
arguments are not a list and a dict fails for good without its handler being called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from durable.conf import DurableSettings
from durable.dispatch.context import enter_fire, leave_fire
from durable.dispatch.registry import HandlerSpec, check_stored_call
from durable.storage import firing as store
from durable.worker.batches import fire_context
from durable.worker.deadline import Deadlines

__all__ = ["BatchCalls", "Call"]

#: What a batch knows of a due timer's handler: its spec, its time limit, its arguments.
Call = tuple[HandlerSpec, float, list[Any], dict[str, Any]]


class BatchCalls:
    """Resolves and calls the handlers of the firer's batches (see the module docstring)."""

    def __init__(
        self,
        *,
        conf: DurableSettings,
        resolvers: dict[str, Callable[[str], HandlerSpec]],
        metrics: Any = None,
    ) -> None:
        self.conf = conf
        self.resolvers = resolvers
        self.metrics = metrics
        self.deadlines = Deadlines()
        self._specs: dict[tuple[str, str], tuple[HandlerSpec, float]] = {}

    @contextmanager
    def batch(self) -> Iterator[None]:
        """The calls of one batch: handlers looked up afresh, ``SIGALRM`` held throughout."""
        self._specs = {}
        with self.deadlines.batch():
            yield

    def lookup(self, timer: store.DueTimer) -> Call:
        """The timer's handler, time limit and arguments; raises what a bad row deserves
        (an unknown handler or kind: ``LookupError``; stored arguments of the wrong JSON
        type: :class:`~durable.exceptions.GiveUp`)."""
        found = self._specs.get((timer.kind, timer.target))
        if found is None:
            spec = self._resolve(timer)
            found = self._specs[timer.kind, timer.target] = (spec, self._timeout(spec))
        if timer.args_json == "[]" and timer.kwargs_json == "{}":
            return found[0], found[1], [], {}
        args, kwargs = timer.args, timer.kwargs
        check_stored_call(args, kwargs)  # a bad row fails for good
        return found[0], found[1], args, kwargs

    def call(self, timer: store.DueTimer, call: Call, now_ms: int, token: int) -> Any:
        """Run an atomic handler as ``timer``'s fire, under its deadline; its result."""
        spec, timeout, args, kwargs = call
        entered = enter_fire(fire_context(timer, now_ms, token, self.metrics))
        deadlines = self.deadlines
        deadlines.start(timeout)
        try:
            return spec.fn(*args, **kwargs)
        finally:
            deadlines.stop()  # first: an alarm from now on interrupts nothing
            leave_fire(entered)

    def _timeout(self, spec: HandlerSpec) -> float:
        # Its own timeout or ATOMIC_TIMEOUT_S, never more than half the lease: an atomic
        # handler holds the loop, which renews the leases.
        timeout = spec.timeout if spec.timeout is not None else self.conf.ATOMIC_TIMEOUT_S
        return min(timeout, self.conf.LEASE_TTL_S / 2)

    def _resolve(self, timer: store.DueTimer) -> HandlerSpec:
        try:
            resolver = self.resolvers[timer.kind]
        except KeyError:
            raise LookupError(f"no dispatcher for timer kind {timer.kind!r}") from None
        return resolver(timer.target)
