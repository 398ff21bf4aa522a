"""Attempts a worker that survived its batch's failure gives back (DESIGN §12).

An attempt is counted before its batch runs (:func:`durable.storage.claims.
count_attempts`), committed on its own, so that a handler that takes its process down
has spent it: poison work takes down at most ``max_attempts`` processes. But a worker
still alive when its batch transaction failed (a database error: its session was
terminated, the server restarted; or a shard found lost under it) knows more: nothing
of that batch took effect, and nothing in it took the process down. Spending those
attempts all the same dead-lettered healthy timers whose attempts faults kept cutting
short (the chaos run, seed 20261201: eleven timers, ``AttemptsExhausted``). So the
worker gives them back, except where the failure may be the handler's own doing:

- a timer whose handler never started in the failed batch (external ones, which would
  have run after commit, those after the failure, or all of them when it came before
  any handler ran) gets its attempt back, as if it had never been counted;
- a timer whose atomic handler ran in the failed batch gets it back, but stays a
  *suspect*: its next attempt runs in a batch of its own (as does one that was a
  suspect already);
- the attempt stays spent when the database error surfaced inside the timer's own
  handler, or when its handler was the only one that ran: a handler that breaks its
  own session (one that terminates it, say) must still reach its dead letter.

The give-back is conditional (:func:`durable.storage.claims.give_back`): only where the
row still has the attempts and the token it was counted with. If the database cannot
be reached to give them back, the attempts stay spent: the safe side.

A worker that died between the count and its batch's commit gives nothing back, but an
external handler (a plain ``atomic=False`` one) runs only after that commit: a pending
suspect with such a handler never started its last attempt. The next batch that counts
it gives that attempt back (:meth:`AttemptTracker.refund_unstarted`), and one that finds
its attempts used up gives it back instead of dead-lettering it
(:meth:`AttemptTracker.refund_exhausted`): an attempt counts only if its handler may
have started.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from durable.storage import claims
from durable.storage.firing import DueTimer
from durable.worker.logs import event

log = logging.getLogger("durable.worker")


class AttemptTracker:
    """What one :meth:`durable.worker.firer.Firer.fire` call counted, ran and committed."""

    def __init__(self, db: str, counted: claims.Counted, tokens: dict[int, int]) -> None:
        self.db = db
        self.counted = counted
        self.tokens = tokens
        """The lease token each counted timer was counted under."""
        self.started: set[int] = set()
        """Timers whose atomic handler was called in a transaction not (yet) committed."""
        self.blamed: set[int] = set()
        """Timers whose own handler raised the database error that failed their batch."""
        self.settled: set[int] = set()
        """Timers whose batch committed (or whose attempt is otherwise accounted for)."""

    def blame(self, timer_id: int, exc: BaseException) -> None:
        """``timer_id``'s handler raised ``exc``: a database error raised there may be its
        own doing (it broke its session), so its attempt stays spent if the batch fails."""
        if isinstance(exc, OperationalError | InterfaceError):
            self.blamed.add(timer_id)

    def settle(self, ids: Iterable[int]) -> None:
        """These timers' batch committed: their attempts are accounted for."""
        self.settled.update(ids)

    def refund_unstarted(self, timer: DueTimer) -> DueTimer:
        """``timer``, which runs on a handler thread after the batch commits; if it was
        counted as a suspect, the attempt before never started it
        (:func:`durable.storage.claims.refund_unstarted`), so this one takes its number.

        In the batch transaction: if the batch fails, the refund rolls back with it and
        :meth:`give_back` still matches the row as counted. If the batch leaves the timer
        over, :func:`~durable.storage.claims.uncount` clears its token: with the refund,
        it is no suspect any more.
        """
        if timer.id not in self.counted.suspects or timer.kind != "handler":
            return timer
        if not claims.refund_unstarted(self.db, timer.id, clear=False):
            return timer
        self.counted.previous[timer.id] = None
        return timer._replace(attempts=timer.attempts - 1)

    def refund_exhausted(self, timer: DueTimer, external: Callable[[], bool]) -> bool:
        """True if ``timer``, not counted because its attempts are used up, got its last
        one back: it never started (a pending suspect whose handler is ``external()``).
        The firer then leaves it for the next batch, which counts and runs it, instead
        of dead-lettering it."""
        if timer.kind != "handler" or timer.attempts < timer.max_attempts:
            return False
        if timer.id in self.counted.held or not external():
            return False
        return claims.refund_unstarted(self.db, timer.id, clear=True)

    def give_back(self, now_ms: int, *, reconnect: bool) -> int:
        """Give back the attempts of counted timers whose batch never committed (see the
        module docstring); return how many rows got one back. ``reconnect``: the batch
        failed on a database error, so the connection may be broken: use a new one."""
        unsettled = self.counted.ids - self.settled
        if not unsettled:
            return 0
        ran = unsettled & self.started
        kept = self.blamed & unsettled
        if len(ran) == 1:
            kept |= ran
        clear = unsettled - ran - kept - self.counted.suspects  # suspects stay suspects
        suspect = unsettled - kept - clear

        def plan(ids: set[int]) -> dict[int, tuple[int, int]]:
            return {i: (self.counted.attempts[i], self.tokens[i]) for i in ids}

        if reconnect:
            with contextlib.suppress(Exception):
                connections[self.db].close()
        # No transaction around them: each statement commits on its own, so no row lock
        # outlives the statement that took it. A worker frozen (SIGSTOP, a VM pause)
        # between two statements of one transaction kept its rows locked until it woke
        # or PostgreSQL's idle timeout (2 x LEASE_TTL_S) ended it, and the shard's new
        # owner, counting those rows, stalled its whole fire loop on them (issue 17:
        # every shard of it silent for 5 s). Every row is given back on its own
        # condition, so a part given back when the rest is not is as safe as all of it
        # (after an error, the warning's count includes the rows given back before it).
        try:
            given = claims.give_back(self.db, plan(clear), now_ms, suspect=False)
            given += claims.give_back(self.db, plan(suspect), now_ms, suspect=True)
        except DatabaseError as exc:
            event(
                log,
                logging.WARNING,
                "attempts.not_given_back",
                timers=len(unsettled),
                error=str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc),
            )
            with contextlib.suppress(Exception):
                connections[self.db].close()
            return 0
        event(
            log,
            logging.INFO,
            "attempts.given_back",
            given=given,
            unstarted=len(clear),
            suspects=len(suspect),
            kept=",".join(map(str, sorted(kept))),
        )
        return given
