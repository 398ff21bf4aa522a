"""A handler's limits per key: which key a call belongs to, how many may run, how often.

``@durable.handler(concurrency_key=..., max_concurrency=N, rate_limit="100/m")`` builds one
:class:`ConcurrencyPolicy`; ``schedule()`` asks it for the key of each call
(:meth:`ConcurrencyPolicy.key_for`) and stores it on the timer, so the worker never calls
user code to decide admission. Keys are scoped by handler: the same key string under two
handlers names two limits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from durable.core.ratelimit import Rate, parse_rate
from durable.exceptions import TimerError

#: Longest key a call may produce (the stored name adds the handler's dotted name).
MAX_KEY_CHARS = 120


class ConcurrencyKeyError(TimerError, ValueError):
    """A handler's ``concurrency_key`` callable raised or returned something unusable."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcurrencyPolicy:
    """Per ``key``: at most ``max_concurrency`` attempts at once, at most ``rate`` starts."""

    key: str | Callable[..., Any]
    """A fixed key, or a callable given the call's arguments that returns the key."""
    max_concurrency: int | None = None
    """``None``: no limit on attempts at once (a rate alone)."""
    rate: Rate | None = None
    """``None``: no limit on starts per period."""

    def key_for(self, handler: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The stored key of one call: ``"<handler>:<key>"``.

        Raises :class:`ConcurrencyKeyError` naming the handler when the callable raises
        or returns anything but a non-empty ``str`` of at most ``MAX_KEY_CHARS``.
        """
        if isinstance(self.key, str):
            return f"{handler}:{self.key}"
        try:
            value = self.key(*args, **kwargs)
        except Exception as exc:
            raise ConcurrencyKeyError(
                f"concurrency_key of handler {handler!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        return f"{handler}:{check_key(value, f'concurrency_key of handler {handler!r} returned')}"


def policy(
    concurrency_key: Any, max_concurrency: Any, rate_limit: Any = None, owner: str = "handler"
) -> ConcurrencyPolicy | None:
    """Validate ``@durable.handler``'s (or, ``owner="workflow"``, ``@durable.workflow``'s)
    limit options; ``None`` when none is given.

    A key needs a limit (``max_concurrency``, ``rate_limit`` or both) and a limit needs
    a key, else ``TypeError``; a ``max_concurrency`` that is not an integer >= 1 or a
    ``rate_limit`` that is not ``"N/s"``, ``"N/m"`` or ``"N/h"`` raises ``ValueError``.
    """
    if concurrency_key is None and max_concurrency is None and rate_limit is None:
        return None
    if concurrency_key is None or (max_concurrency is None and rate_limit is None):
        raise TypeError(
            "concurrency_key goes with max_concurrency and/or rate_limit: give the key and "
            f"a limit (got concurrency_key={concurrency_key!r}, "
            f"max_concurrency={max_concurrency!r}, rate_limit={rate_limit!r})"
        )
    if max_concurrency is not None:
        if type(max_concurrency) is not int:
            raise TypeError(
                f"max_concurrency: expected an int, got {type(max_concurrency).__name__}"
            )
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    rate = None if rate_limit is None else parse_rate(rate_limit)
    if isinstance(concurrency_key, str):
        check_key(concurrency_key, "concurrency_key: the fixed key is")
    elif not callable(concurrency_key):
        raise TypeError(
            f"concurrency_key: expected a str or a callable of the {owner}'s arguments, "
            f"got {type(concurrency_key).__name__}"
        )
    return ConcurrencyPolicy(key=concurrency_key, max_concurrency=max_concurrency, rate=rate)


def check_key(value: Any, what: str) -> str:
    """``value`` if it is a usable key; :class:`ConcurrencyKeyError` saying ``what`` it is."""
    if not isinstance(value, str):
        raise ConcurrencyKeyError(
            f"{what} {value!r:.50} (of type {type(value).__name__}), not a str"
        )
    if not value or len(value) > MAX_KEY_CHARS:
        raise ConcurrencyKeyError(f"{what} {value!r:.50}: must be 1 to {MAX_KEY_CHARS} characters")
    if "\x00" in value or any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise ConcurrencyKeyError(f"{what} {value!r:.50}: NUL and lone surrogates are not allowed")
    return value
