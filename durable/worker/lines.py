"""The line keeper: no key's line waits forever for a wake that will not come.

Work over its key's limit waits parked, and only the end of a running attempt or run of
the key wakes the next (:mod:`durable.storage.concurrency`). A deploy that removes or
raises the limit, or any path that frees a slot without waking anyone (a row deleted by
hand, say), would leave a line waiting with nothing left to end. So each worker, for the
shards it owns, looks at the lines: once when it loads a shard, and every
:data:`KEEP_EVERY_MS` after that. For each key with parked timers it takes the limits
its handler or workflow declares *now* and wakes the heads of the line those leave room
for (:func:`durable.storage.lines.keep`, fenced by the shard's token). It runs between
turns, never in a firing batch.

A key whose handler or workflow this process does not know is left as it is: a worker
of an older release, in a rolling deploy, must not decide for code it does not have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from durable.conf import DurableSettings
from durable.dispatch.registry import HandlerSpec
from durable.exceptions import LeaseLost
from durable.storage import concurrency, lines
from durable.storage.lines import UNLIMITED
from durable.worker.logs import event
from durable.worker.runner import ShardRunner
from durable.workflows.registry import workflows

log = logging.getLogger("durable.worker")

KEEP_EVERY_MS = 60_000
"""How often the keeper looks at the lines of the shards owned (and once at a shard's
load): the longest a stranded line waits, plus one turn, while its shard has an owner."""


class LineKeeper:
    """Wakes stranded lines of the shards the engine owns; see the module docstring."""

    def __init__(
        self, *, db: str, conf: DurableSettings, lookup: Callable[[str], HandlerSpec | None]
    ) -> None:
        self.db = db
        self.conf = conf
        self.lookup = lookup
        self.next_ms = 0
        self.loaded: set[int] = set()  # shards loaded since the last pass

    def shard_loaded(self, shard: int) -> None:
        """A shard was just loaded: look at its lines in this turn."""
        self.loaded.add(shard)

    def due(self, now_ms: int) -> bool:
        """Whether a pass is due (a shard loaded, or :data:`KEEP_EVERY_MS` passed)."""
        return bool(self.loaded) or now_ms >= self.next_ms

    def run(self, runners: Mapping[int, ShardRunner], now_ms: int) -> int:
        """One pass, when due; the timers made due go into their runners' wheels.

        Returns how many were made due. All owned shards on a periodic pass; only the
        shards loaded since the last one otherwise.
        """
        if not self.due(now_ms):
            return 0
        periodic = now_ms >= self.next_ms
        if periodic:
            self.next_ms = now_ms + KEEP_EVERY_MS
        shards = set(runners) if periodic else self.loaded & set(runners)
        self.loaded.clear()
        if not shards:
            return 0
        per_shard: dict[int, dict[str, concurrency.Limits]] = {}
        for name, shard, kind, target, run_name in lines.parked_keys(self.db):
            if shard in shards:
                limits = self.limits_of(kind, target, run_name)
                if limits is not None:
                    per_shard.setdefault(shard, {})[name] = limits
        woken = 0
        for shard, limits in sorted(per_shard.items()):
            runner = runners[shard]
            try:
                got = lines.keep(
                    self.db, shard, runner.token, limits, now_ms, self.conf.BUCKET_SHIFT
                )
            except LeaseLost:
                continue  # its new owner keeps its lines; the next renewal drops it here
            for _, timer_id, fire_at in got:
                runner.add(timer_id, fire_at)
            if got:
                event(log, logging.INFO, "lines.woken", shard=shard, timers=len(got))
            woken += len(got)
        return woken

    def limits_of(self, kind: str, target: str, run_name: str | None) -> concurrency.Limits | None:
        """The limits the admission of a timer of ``kind``/``target`` applies now, as
        :mod:`durable.worker.admission` decides them; ``None``: not known here."""
        if kind == "workflow":
            definition = None if run_name is None else workflows.get(run_name)
            if definition is None:
                return None
            policy = definition.concurrency
            return UNLIMITED if policy is None else (policy.max_concurrency, policy.rate)
        spec = self.lookup(target)
        if spec is None:
            return None
        policy = spec.concurrency
        # An atomic handler's admission decides its rate only (see admission.admit).
        if policy is None or (policy.rate is None and spec.atomic):
            return UNLIMITED
        return policy.max_concurrency, policy.rate
