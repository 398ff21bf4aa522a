"""The kinds of value a ``DURABLE`` key accepts, and what a check of them reports.

:data:`durable.conf.RULES` gives each key one of these (an :class:`Integer` range, a
finite :class:`Number`, a :class:`DatabaseAlias`, any other :class:`Predicate`), and
:data:`durable.conf.RELATIONS` the pairs of keys that must agree; each says in words what
it accepts, which is what ``manage.py check`` prints beside a bad value (a
:class:`Problem`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from django.conf import settings


def show_value(value: Any) -> str:
    """``value`` as a check message shows it: its repr (cut at 80) and its type."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def show_number(x: float) -> str:
    """``x`` with thousands separators, without a needless ``.0``."""
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


@dataclass(frozen=True, slots=True)
class Integer:
    """An ``int`` (never a ``bool``) in ``[low, high]``."""

    low: int
    high: int | None = None

    def __call__(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return self.low <= value and (self.high is None or value <= self.high)

    @property
    def requirement(self) -> str:
        if self.high is None:
            return f"an integer >= {show_number(self.low)}"
        return f"an integer from {show_number(self.low)} to {show_number(self.high)}"


@dataclass(frozen=True, slots=True)
class Number:
    """A finite ``int`` or ``float`` (never a ``bool``) above (or from) ``low``, up to ``high``."""

    low: float
    high: float
    above: bool = False  # True: strictly greater than low

    def __call__(self, value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if not math.isfinite(value):
            return False
        low_ok = value > self.low if self.above else value >= self.low
        return low_ok and value <= self.high

    @property
    def requirement(self) -> str:
        low = f"> {show_number(self.low)}" if self.above else f">= {show_number(self.low)}"
        return f"a number (int or float) {low} and <= {show_number(self.high)}"


@dataclass(frozen=True, slots=True)
class Predicate:
    """Any other test, with the words for what it accepts."""

    test: Callable[[Any], bool]
    words: str

    def __call__(self, value: Any) -> bool:
        return self.test(value)

    @property
    def requirement(self) -> str:
        return self.words


@dataclass(frozen=True, slots=True)
class DatabaseAlias:
    """An alias of ``settings.DATABASES`` (read when checking, so overrides count)."""

    optional: bool = False  # True: None is accepted too

    def __call__(self, value: Any) -> bool:
        if value is None:
            return self.optional
        return isinstance(value, str) and value in settings.DATABASES

    @property
    def requirement(self) -> str:
        aliases = ", ".join(repr(a) for a in settings.DATABASES)
        either = "None or " if self.optional else ""
        return f"{either}a database alias in settings.DATABASES ({aliases})"


class Check(Protocol):
    """A value test that can say what it accepts."""

    def __call__(self, value: Any) -> bool: ...

    @property
    def requirement(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Rule:
    """How one key is checked, and the id of the check that reports a bad value."""

    check: Check
    id: str = "durable.E003"

    @property
    def requirement(self) -> str:
        """What a good value is, in the words the check message uses."""
        return self.check.requirement


@dataclass(frozen=True, slots=True)
class Relation:
    """Two keys whose values must agree: ``holds(first, second)``, and why."""

    first: str
    second: str
    holds: Callable[[Any, Any], bool]
    requirement: str
    why: str


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with ``settings.DURABLE``: check id, keys involved, message."""

    id: str
    keys: tuple[str, ...]
    message: str
    hint: str | None = None

    @property
    def unusable(self) -> bool:
        """A value that cannot be used at all (as opposed to two values that disagree)."""
        return self.id != "durable.E005"
