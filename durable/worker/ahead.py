"""Count the next batch's attempts while the current batch finishes (PostgreSQL).

Every batch's attempts are counted before its handlers run, in a statement of their own
that commits first (:func:`durable.storage.claims.count_attempts`). That statement
writes a new version of every due row: in a drain it was about half of the worker's
statement time per fire (docs/benchmarks.md, "Issue 16: the drain (helper)"), and the
loop waited for it between every two batches. :class:`CountAhead` runs the next batch's count on a
connection and thread of its own while the current batch records its outcomes and
commits on the loop's, so the server counts one batch while it finishes the other.

It starts once every handler of the current batch ran (after the suspects that run
alone, when there are any): a handler that takes the process down has then cost the
next batch nothing, as before. A worker killed from outside while its batch commits
(SIGKILL, the OOM killer) leaves the next batch counted, its timers *suspects* that run
alone at their next attempt, as it leaves the batch in flight.

Nothing about the count changes: the same statement, fenced by the same lease tokens,
committed before any handler of its batch runs (:meth:`CountAhead.take` waits for it).
The two batches hold disjoint timer rows, and both statements only share-lock the lease
rows; the loop's own lease writes (a renewal between batches) wait for a count in
flight first (:meth:`CountAhead.wait`), so the two connections never wait on each other.

A count whose batch does not run as counted (the worker is stopping, a shard was dropped
meanwhile, the batch before it failed on a database error) is given back with
:meth:`durable.worker.attempts.AttemptTracker.give_back`, on the condition that each row
still has the attempts and token it was counted with: as if it had never been counted.
Off PostgreSQL (one writer), or when the loop's connection is inside a transaction (a
test's: another connection could not see its rows), every count runs in the loop.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from django.db import InterfaceError, OperationalError, connections

from durable.core.clock import Clock
from durable.storage import claims
from durable.worker import counting
from durable.worker.attempts import AttemptTracker
from durable.worker.batches import Work

__all__ = ["CountAhead"]

Counts = tuple[claims.Counted, dict[int, str]]
"""A count's result: what it counted, and the shards it found lost (shard -> why)."""


def _key(work: Work) -> tuple[Any, ...]:
    """What a count was made for: the same runners, under the same tokens, the same ids."""
    return tuple((id(runner), runner.token, tuple(ids)) for runner, ids in work)


class CountAhead:
    """Counts a batch's attempts on a thread of its own (see the module docstring)."""

    def __init__(self, db: str, clock: Clock) -> None:
        self.db = db
        self.clock = clock
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[Work, tuple[Any, ...], Future[Counts]] | None = None

    @property
    def pending(self) -> bool:
        """Whether a count made ahead waits for its batch."""
        return self._pending is not None

    def enabled(self) -> bool:
        """Whether a count may run on another connection (PostgreSQL, and no transaction
        open on the loop's: asked before the batch's own begins)."""
        conn = connections[self.db]
        return conn.vendor == "postgresql" and not conn.in_atomic_block

    def start(self, work: Work) -> None:
        """Start counting ``work`` (the next batch): only where :meth:`enabled` said so
        before the current batch's transaction began."""
        self.drop()  # one count ahead at most
        if not work:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="durable-count")
        future = self._executor.submit(self._count, list(work))
        self._pending = (work, _key(work), future)

    def take(self, work: Work) -> Counts | None:
        """The count made ahead for exactly ``work``, once committed; None if there is
        none (a count made for other work is given back: count this work now)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        counted_work, key, future = pending
        if key == _key(work):
            counted, lost = future.result()  # its error, if any, is the batch's
            return counted, dict(lost)
        self._give_back(counted_work, future)
        return None

    def wait(self) -> None:
        """Wait until the count in flight, if any, has finished (kept for :meth:`take`):
        before the loop writes lease rows, which the count share-locks."""
        if self._pending is not None:
            self._pending[2].exception()

    def drop(self) -> None:
        """Give back the count in flight, if any: its batch will not run."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._give_back(pending[0], pending[2])

    def close(self) -> None:
        """Give back what is in flight, close the thread's connection, end the thread."""
        self.drop()
        if self._executor is not None:
            with contextlib.suppress(Exception):  # a broken connection may refuse
                self._executor.submit(connections.close_all).result()
            self._executor.shutdown(wait=True)
            self._executor = None

    def _count(self, work: Work) -> Counts:
        lost: dict[int, str] = {}
        try:
            return counting.count(self.db, self.clock, work, lost), lost
        except (OperationalError, InterfaceError):
            connections[self.db].close()  # broken: the next count connects again
            raise

    def _give_back(self, work: Work, future: Future[Counts]) -> None:
        if future.exception() is not None:
            return  # nothing was counted (or what was is lost with the connection)
        counted, _ = future.result()
        tokens = {i: runner.token for runner, ids in work for i in ids if i in counted.ids}
        AttemptTracker(self.db, counted, tokens).give_back(self.clock.now_ms(), reconnect=False)
