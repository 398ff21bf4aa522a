"""Validation of what callers pass to ``schedule()`` and ``@durable.handler``.

Everything here runs before any write, so bad input fails at the call site with a message
naming the offending argument (and, for payloads, the path inside it) and leaves the
database untouched (DESIGN §11). Helpers take a ``where`` prefix so that
``schedule_many`` can say ``specs[12].args[0]: ...`` with the same code.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from durable.core.backoff import Backoff
from durable.core.timeutil import ceil_ms, datetime_to_ms
from durable.exceptions import PayloadError

MAX_KEY_LENGTH = 255
#: The latest instant a timer, sleep or deadline may be due. A day before the end of year
#: 9999, so that it converts back to a Python ``datetime`` in every time zone.
MAX_INSTANT = datetime(9999, 12, 30, tzinfo=UTC)
#: :data:`MAX_INSTANT` in epoch milliseconds.
MAX_INSTANT_MS = datetime_to_ms(MAX_INSTANT)
#: The largest ``max_attempts``: ``Timer.max_attempts`` is a 32-bit integer column.
MAX_ATTEMPTS_LIMIT = 2_147_483_647
#: The most digits an int in a payload may have: Python's default limit for converting
#: an int to and from text (``sys.get_int_max_str_digits()``), which JSON does.
MAX_INT_DIGITS = 4300
_INT_LIMIT = 10**MAX_INT_DIGITS
_LONGEST_DELAY = timedelta(milliseconds=MAX_INSTANT_MS)
# Deep enough for any real payload; shallow enough to report a reference cycle clearly
# instead of overflowing the stack.
MAX_DEPTH = 100


def label(where: str, name: str) -> str:
    """Return how messages name argument ``name``: ``"at"`` or ``"specs[3].at"``."""
    return f"{where}.{name}" if where else name


def fire_at_ms(at: Any, delay: Any, now_ms: int, where: str = "") -> int:
    """Return when a timer is due, in epoch ms: at ``at``, after ``delay``, or now.

    ``at`` in the past is accepted: the timer fires as soon as possible.
    """
    if at is not None and delay is not None:
        raise ValueError(
            f"{label(where, 'at')}/{label(where, 'delay')}: pass at most one of at= and delay="
        )
    if at is not None:
        if not isinstance(at, datetime):
            raise TypeError(
                f"{label(where, 'at')}: expected an aware datetime, got {type(at).__name__}"
            )
        if at.tzinfo is None or at.utcoffset() is None:
            raise ValueError(
                f"{label(where, 'at')}: naive datetime {at!r} is ambiguous; "
                "use an aware datetime (django.utils.timezone.now())"
            )
        return check_instant_ms(datetime_to_ms(at), label(where, "at"), at)
    if delay is not None:
        return now_ms + check_delay(delay, now_ms, label(where, "delay"))
    return now_ms


def check_delay(delay: Any, now_ms: int, name: str, *, positive: bool = False) -> int:
    """Return ``delay`` (a timedelta >= 0, or > 0 if ``positive``) in ms, rounded up.

    ``now + delay`` must not pass :data:`MAX_INSTANT`; errors name the argument ``name``.
    """
    if not isinstance(delay, timedelta):
        raise TypeError(f"{name}: expected a timedelta, got {type(delay).__name__}")
    if positive and delay <= timedelta(0):
        raise ValueError(f"{name}: must be positive, got {delay!r}")
    if delay < timedelta(0):
        raise ValueError(f"{name}: must not be negative, got {delay!r}")
    if delay > _LONGEST_DELAY:  # also keeps timedelta.max away from ceil_ms's negation
        check_instant_ms(MAX_INSTANT_MS + 1, name, delay)
    ms = ceil_ms(delay)
    check_instant_ms(now_ms + ms, name, delay)
    return ms


def check_instant_ms(ms: int, name: str, given: Any) -> int:
    """Return ``ms`` unless it is after :data:`MAX_INSTANT` (``ValueError`` naming ``name``)."""
    if ms > MAX_INSTANT_MS:
        raise ValueError(
            f"{name}: {given!r} is after {MAX_INSTANT.isoformat()}, the latest instant "
            "durable accepts"
        )
    return ms


def check_text(value: Any, name: str, where: str = "") -> Any:
    """Return ``value``; if it is a str holding NUL or a lone surrogate, raise ``ValueError``.

    Names, keys and ids are stored in text columns, which cannot hold either. Other
    checks (type, length) stay with the caller.
    """
    if isinstance(value, str):
        try:
            _check_text(value)
        except _NotJson as bad:
            raise ValueError(f"{label(where, name)}: {bad.problem}") from None
    return value


@dataclass(frozen=True, slots=True)
class CallShape:
    """A callable's signature, with the positional-argument counts that surely bind when
    no keyword argument is passed: the common case, checked without ``bind()``."""

    signature: inspect.Signature | None
    low: float = 0
    high: float = math.inf


def call_shape(fn: Callable[..., Any]) -> CallShape:
    """``fn``'s :class:`CallShape`; a signature that cannot be read is never checked."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return CallShape(None)
    params = signature.parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_keyword = any(p.kind == p.KEYWORD_ONLY and p.default is p.empty for p in params)
    low = sum(p.default is p.empty for p in positional)
    high = math.inf if any(p.kind == p.VAR_POSITIONAL for p in params) else len(positional)
    return CallShape(signature, math.inf if required_keyword else low, high)


def check_binds(
    shape: CallShape, what: str, args: Any, kwargs: Any, where: str = "", name: str = ""
) -> None:
    """Raise ``TypeError`` if ``(*args, **kwargs)`` does not bind to ``shape``'s signature.

    ``what`` names the callee in the message (``handler app.handlers.send``); ``name`` the
    argument blamed (default ``args/kwargs``).
    """
    signature = shape.signature
    if signature is None or (not kwargs and shape.low <= len(args) <= shape.high):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        names = label(where, name) if name else f"{label(where, 'args')}/{label(where, 'kwargs')}"
        plain = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        raise TypeError(f"{names}: do not fit {what}{plain}: {exc}") from None


def check_key(key: Any, where: str = "") -> str | None:
    """Return a valid idempotency key (1 to 255 characters) or ``None``."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"{label(where, 'key')}: expected a str, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise ValueError(
            f"{label(where, 'key')}: must be 1 to {MAX_KEY_LENGTH} characters, got {len(key)}"
        )
    return check_text(key, "key", where)


def check_max_attempts(value: Any, where: str = "", name: str = "max_attempts") -> int | None:
    """Return ``value`` if it is ``None`` or an int from 1 to :data:`MAX_ATTEMPTS_LIMIT`;
    raise naming the argument otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label(where, name)}: expected an int >= 1, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{label(where, name)}: must be >= 1, got {value}")
    if value > MAX_ATTEMPTS_LIMIT:
        raise ValueError(
            f"{label(where, name)}: must be at most {MAX_ATTEMPTS_LIMIT:,} (a 32-bit column), "
            f"got {value}"
        )
    return value


def to_backoff(value: Any, max_s: float, where: str = "", name: str = "backoff") -> Backoff | None:
    """Return ``value`` as a :class:`Backoff`; a ``timedelta`` is a base delay, capped at max_s."""
    if value is None or isinstance(value, Backoff):
        return value
    if not isinstance(value, timedelta):
        raise TypeError(
            f"{label(where, name)}: expected a durable.Backoff or a timedelta, "
            f"got {type(value).__name__}"
        )
    base_s = value.total_seconds()
    if base_s <= 0:
        raise ValueError(f"{label(where, name)}: the base delay must be positive, got {value!r}")
    if base_s > max_s:
        raise ValueError(
            f"{label(where, name)}: base delay {value!r} exceeds DURABLE['BACKOFF_MAX_S'] = "
            f"{max_s} s; pass durable.Backoff(base_s=..., max_s=...) to choose the cap"
        )
    return Backoff(base_s=base_s, max_s=max_s)


def check_payload(
    args: Any, kwargs: Any, context: Any, max_bytes: int, where: str = ""
) -> tuple[list[Any], dict[str, Any]]:
    """Check args, kwargs and context are strict JSON within ``max_bytes``; return args, kwargs.

    ``args`` comes back as a new list and ``kwargs`` a new dict (``None`` gives ``{}``). The
    size is the sum of their compact UTF-8 JSON encodings (a ``None`` context is not stored).
    """
    if not isinstance(args, list | tuple):
        raise PayloadError(
            f"{label(where, 'args')}: expected a list or tuple, got {type(args).__name__}",
            path=label(where, "args"),
        )
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise PayloadError(
            f"{label(where, 'kwargs')}: expected a dict, got {type(kwargs).__name__}",
            path=label(where, "kwargs"),
        )
    bound = _bound(args, where, "args") + _bound(kwargs, where, "kwargs")
    if context is not None:
        bound += _bound(context, where, "context")
    # The walk's bound is cheap; encode for the exact size only when it could matter.
    if bound > max_bytes:
        parts = (args, kwargs) if context is None else (args, kwargs, context)
        size = sum(len(_compact(value).encode()) for value in parts)
        if size > max_bytes:
            raise PayloadError(
                f"{where + ': ' if where else ''}payload (args + kwargs + context) is {size} "
                f"bytes of JSON; the limit is DURABLE['MAX_PAYLOAD_BYTES'] = {max_bytes}",
                size=size,
                limit=max_bytes,
            )
    return list(args), dict(kwargs)  # copies: the caller may reuse theirs


def check_json(value: Any, path: str) -> None:
    """Raise :class:`PayloadError` naming the path of the first part of ``value`` not strict JSON.

    Strict JSON: dicts with str keys, lists, tuples, str, int, bool, None and finite
    floats. Strings may not hold NUL or lone surrogates, which PostgreSQL cannot store.
    """
    json_size_bound(value, path)


def check_stored(value: Any, path: str, max_bytes: int, setting: str) -> None:
    """Like :func:`check_json`, and its compact UTF-8 JSON must be at most ``max_bytes``.

    For a value durable stores (a result, a signal's payload); ``setting`` names the
    ``DURABLE`` key of the limit in the message. A :class:`PayloadError` too large has
    ``size`` and ``limit`` attributes.
    """
    if json_size_bound(value, path) > max_bytes:
        size = len(_compact(value).encode())
        if size > max_bytes:
            raise PayloadError(
                f"{path}: {size} bytes of JSON; the limit is DURABLE[{setting!r}] = {max_bytes}",
                path=path,
                size=size,
                limit=max_bytes,
            )


def json_size_bound(value: Any, path: str) -> int:
    """Check ``value`` like :func:`check_json` and return an upper bound of its JSON size."""
    try:
        return _walk(value, 0)
    except _NotJson as bad:
        where = path + "".join(reversed(bad.segments))
        raise PayloadError(f"{where}: {bad.problem}", path=where) from None


def _bound(value: Any, where: str, name: str) -> int:
    # json_size_bound() with the path built only on error: this runs for every timer.
    try:
        return _walk(value, 0)
    except _NotJson:
        return json_size_bound(value, label(where, name))


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


_BASES: tuple[tuple[type, Any], ...] = (
    (str, str.__str__),
    (int, int.__int__),
    (list, list),
    (tuple, tuple),
    (dict, dict),
)


class _NotJson(Exception):
    """Raised inside the walk; the path is assembled on the way out, so valid input builds none."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.segments: list[str] = []


def _walk(value: Any, depth: int) -> int:
    # Returns an upper bound of the compact UTF-8 encoding: 6 bytes a character covers
    # the worst escape (\u001f); an int has fewer than bit_length / 3 + 2 digits.
    # Exact-type tests first: this runs for every value of every timer scheduled.
    kind = type(value)
    if kind is str:
        _check_text(value)
        return 6 * len(value) + 2
    if kind is int:
        bits = value.bit_length()
        if bits > 14_000 and abs(value) >= _INT_LIMIT:  # 10**4300 has 14,284 bits
            raise _NotJson(f"int has more than {MAX_INT_DIGITS} digits, too many for JSON")
        return int(bits) // 3 + 3
    if kind is list or kind is tuple:
        return _walk_list(value, depth)
    if kind is dict:
        return _walk_dict(value, depth)
    if value is None or kind is bool:
        return 5
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _NotJson(f"float {value!r} is not JSON")
        return 32
    # Subclasses (StrEnum, IntEnum, OrderedDict, ...) encode like their base type; the
    # base's own conversion sees the underlying value, whatever __str__ says.
    for base, plain in _BASES:
        if isinstance(value, base):
            return _walk(plain(value), depth)
    raise _NotJson(f"{type(value).__name__} is not JSON-serializable")


def _walk_list(value: list[Any] | tuple[Any, ...], depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise _NotJson(f"nested more than {MAX_DEPTH} levels deep (a reference cycle?)")
    size = 2
    for index, item in enumerate(value):
        try:
            size += _walk(item, depth + 1) + 1
        except _NotJson as bad:
            bad.segments.append(f"[{index}]")
            raise
    return size


def _walk_dict(value: dict[Any, Any], depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise _NotJson(f"nested more than {MAX_DEPTH} levels deep (a reference cycle?)")
    size = 2
    for key, item in value.items():
        if not isinstance(key, str):
            raise _NotJson(f"dict key {key!r} is {type(key).__name__}; JSON keys must be str")
        _check_text(key)  # a bad key is reported at the dict's path, not under itself
        try:
            size += _walk(item, depth + 1) + 6 * len(key) + 4
        except _NotJson as bad:
            bad.segments.append(f"[{key!r}]")
            raise
    return size


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise _NotJson("str contains NUL (\\x00), which PostgreSQL cannot store")
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise _NotJson("str contains a lone surrogate; it is not valid Unicode") from None


def check_timeout(timeout: Any) -> float | None:
    """A handler's ``timeout`` in seconds: positive and finite, or None; else an error."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout: expected seconds or a timedelta, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout: expected a positive, finite number of seconds, got {timeout!r}")
    return float(timeout)
