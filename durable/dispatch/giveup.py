"""Which failures are final: :class:`~durable.exceptions.GiveUp`, ``retry_on`` and ``give_up_on``.

A failed attempt is normally retried with backoff until ``max_attempts``. It is *final*
(dead-lettered at once, its remaining attempts unused) when what the handler or step
raised

1. is a ``GiveUp`` (always, whatever the policy says);
2. else is an instance of a class in ``give_up_on``;
3. else ``retry_on`` is given and it is an instance of none of its classes.

So ``give_up_on`` wins over ``retry_on`` (``retry_on=(OSError,),
give_up_on=(FileNotFoundError,)`` retries every ``OSError`` but that one). Durable's
own verdicts on an attempt, :class:`~durable.exceptions.HandlerTimeout` (it ran past
its timeout) and :class:`~durable.exceptions.HandlerAborted` (it raised a
``BaseException``), are not "not in ``retry_on``": they are retried unless
``give_up_on`` names them. Pure: no Django, shared by the worker, the kombu executors
and workflow steps.
"""

from __future__ import annotations

from typing import Any

from durable.core.errors import sanitize_error
from durable.exceptions import GiveUp, HandlerAborted, HandlerTimeout

#: A validated ``retry_on``/``give_up_on``: a tuple of ``Exception`` subclasses.
Exceptions = tuple[type[Exception], ...]

# Failures durable pins on an attempt, not raised by the code: retry_on does not judge them.
_DURABLES = (HandlerTimeout, HandlerAborted)


class GaveUp(GiveUp):
    """The ``retry_on``/``give_up_on`` policy made ``cause`` final (the worker's marker:
    the stored error is the cause's own, ``"ValueError: ..."``)."""


def check_exceptions(value: Any, name: str) -> Exceptions:
    """``value`` (None, an ``Exception`` subclass, or a tuple/list of them) as a tuple.

    Raises ``TypeError``/``ValueError`` naming ``name`` for anything else, an empty
    tuple included (``None`` is the way to say "no policy").
    """
    if value is None:
        return ()
    items = tuple(value) if isinstance(value, tuple | list) else (value,)
    if not items:
        raise ValueError(f"{name}: expected at least one exception class (or None), got ()")
    for item in items:
        if not (isinstance(item, type) and issubclass(item, Exception)):
            shown = item.__name__ if isinstance(item, type) else repr(item)
            raise TypeError(
                f"{name}: expected Exception subclasses (a class or a tuple of classes), "
                f"got {shown}"
            )
    return items


def gives_up(exc: BaseException, retry_on: Exceptions, give_up_on: Exceptions) -> bool:
    """Whether the failure ``exc`` is final under the policy (see the module docstring)."""
    if isinstance(exc, GiveUp):
        return True
    if give_up_on and isinstance(exc, give_up_on):
        return True
    return bool(retry_on) and not isinstance(exc, retry_on) and not isinstance(exc, _DURABLES)


def final(exc: BaseException, retry_on: Exceptions, give_up_on: Exceptions) -> BaseException:
    """``exc`` as the worker records it: wrapped in :class:`GaveUp` if the policy makes it
    final (a ``GiveUp`` stays itself), else unchanged."""
    if isinstance(exc, GiveUp) or not gives_up(exc, retry_on, give_up_on):
        return exc
    return GaveUp(cause=exc)


def is_final(exc: BaseException) -> bool:
    """Whether a recorded failure must not be retried."""
    return isinstance(exc, GiveUp)


def error_text(exc: BaseException) -> str:
    """The stored error of a failure: the cause's for a policy's verdict, else its own."""
    if isinstance(exc, GaveUp) and exc.cause is not None:
        return sanitize_error(exc.cause)
    return sanitize_error(exc)
