"""Concurrency keys on workflows: a run's key, decided when it starts, and its shard.

``@durable.workflow(concurrency_key=..., max_concurrency=N)`` limits the runs of a key
*in progress*: a run holds a slot of its key from its first replay (its admission) to
its end (completed, failed, cancelled), across its sleeps and waits. The key is decided
here, by ``start()``/``start_many()``/``ctx.start_child`` with the run's arguments, and
stored on the run and on its start timer: the worker never calls user code to decide.

A keyed run lives on its key's shard (its every timer is routed there), so the key's
shard owner admits its start timer, under its lease token, with the handler machinery
(:mod:`durable.storage.concurrency`): a start over the limit waits as a parked timer in
the key's line, in arrival order, and the transaction that records a run's end makes the
next one due (:mod:`durable.storage.run_slots`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from durable.core.sharding import shard_for
from durable.dispatch.concurrency import ConcurrencyKeyError, check_key

if TYPE_CHECKING:
    from durable.workflows.registry import WorkflowDef

#: Stored keys of workflows start with this: a handler's never do (``"<dotted name>:"``).
PREFIX = "workflow:"
#: ``WorkflowRun.concurrency_key``'s and ``Timer.concurrency_key``'s length.
MAX_STORED_CHARS = 255


def key_for(definition: WorkflowDef, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The stored key of one start (``"workflow:<name>:<key>"``), or ``None`` without limits.

    ``args``/``kwargs`` are the run's arguments as its code receives them. Raises
    :class:`~durable.dispatch.concurrency.ConcurrencyKeyError` naming the workflow when
    the callable raises or returns anything but a ``str`` of 1 to 120 characters.
    """
    limits = definition.concurrency
    if limits is None:
        return None
    what = f"concurrency_key of workflow {definition.name!r}"
    if isinstance(limits.key, str):
        value = limits.key
    else:
        try:
            value = limits.key(*args, **kwargs)
        except Exception as exc:
            raise ConcurrencyKeyError(f"{what} raised {type(exc).__name__}: {exc}") from exc
        value = check_key(value, f"{what} returned")
    stored = f"{PREFIX}{definition.name}:{value}"
    if len(stored) > MAX_STORED_CHARS:
        raise ConcurrencyKeyError(
            f"{what}: {stored[:50]!r}... is {len(stored)} characters with the workflow's "
            f"name; at most {MAX_STORED_CHARS} are stored (shorten the key or the name)"
        )
    return stored


def run_shard(run_id: str, key: str | None, shards: int) -> int:
    """A run's shard: its key's, so the key's owner replays and admits it; else its id's."""
    return shard_for(run_id if key is None else key, shards)
