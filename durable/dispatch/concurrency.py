"""A handler's concurrency policy: which key a call belongs to, and how many may run.

``@durable.handler(concurrency_key=..., max_concurrency=N)`` builds one
:class:`ConcurrencyPolicy`; ``schedule()`` asks it for the key of each call
(:meth:`ConcurrencyPolicy.key_for`) and stores it on the timer, so the worker never calls
user code to decide admission. Keys are scoped by handler: the same key string under two
handlers names two limits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from durable.exceptions import TimerError

#: Longest key a call may produce (the stored name adds the handler's dotted name).
MAX_KEY_CHARS = 120


class ConcurrencyKeyError(TimerError, ValueError):
    """A handler's ``concurrency_key`` callable raised or returned something unusable."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConcurrencyPolicy:
    """``max_concurrency`` attempts of a handler may run at once per ``key``."""

    key: str | Callable[..., Any]
    """A fixed key, or a callable given the call's arguments that returns the key."""
    max_concurrency: int

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


def policy(concurrency_key: Any, max_concurrency: Any) -> ConcurrencyPolicy | None:
    """Validate ``@durable.handler``'s two options; ``None`` when neither is given.

    Both or neither: a key without a limit, or a limit without a key, raises
    ``TypeError``; a limit that is not an integer >= 1 raises ``ValueError``.
    """
    if concurrency_key is None and max_concurrency is None:
        return None
    if concurrency_key is None or max_concurrency is None:
        raise TypeError(
            "concurrency_key and max_concurrency go together: give both "
            f"(got concurrency_key={concurrency_key!r}, max_concurrency={max_concurrency!r})"
        )
    if type(max_concurrency) is not int:
        raise TypeError(f"max_concurrency: expected an int, got {type(max_concurrency).__name__}")
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    if isinstance(concurrency_key, str):
        check_key(concurrency_key, "concurrency_key: the fixed key is")
    elif not callable(concurrency_key):
        raise TypeError(
            "concurrency_key: expected a str or a callable of the handler's arguments, "
            f"got {type(concurrency_key).__name__}"
        )
    return ConcurrencyPolicy(key=concurrency_key, max_concurrency=max_concurrency)


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
