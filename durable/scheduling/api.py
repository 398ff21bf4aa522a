"""``schedule``, ``schedule_many`` and ``cancel``: the public timer API.

Each call validates everything first, then writes on ``DURABLE["DATABASE"]`` inside the
caller's transaction: it never commits on its own, and a rollback leaves nothing behind.
Near-term timers are announced to their worker with PostgreSQL NOTIFY in that same
transaction, delivered only if it commits. A ``schedule()`` without a parent is one
statement on PostgreSQL, the insert and its NOTIFY (:mod:`durable.storage.single`); in
autocommit mode that statement is its own transaction.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from types import FunctionType
from typing import Any

from django.db import transaction

from durable.conf import DurableSettings, get_settings
from durable.core.backoff import Backoff
from durable.core.clock import current_clock
from durable.dispatch.registry import HandlerSpec, handler_name, handlers
from durable.exceptions import TimerError, UnknownHandler
from durable.models import Timer, TimerKind
from durable.scheduling import debounce as debouncing
from durable.scheduling import validation as v
from durable.storage import debounce as debounce_store
from durable.storage import parents, single
from durable.storage import timers as store
from durable.storage.bulk import paused_gc

SPEC_KEYS = frozenset(
    {"fn", "args", "kwargs", "at", "delay", "key", "max_attempts", "backoff"}
    | {"on_complete", "context", "parent"}
)

#: What an ``on_complete`` handler is called with, by keyword.
FOLLOWUP_KWARGS = {"timer_id": 0, "context": None, "result": {}}


def schedule(
    fn_or_dotted_name: Callable[..., Any] | str,
    *,
    args: list[Any] | tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    at: datetime | None = None,
    delay: timedelta | None = None,
    key: str | None = None,
    max_attempts: int | None = None,
    backoff: Backoff | timedelta | None = None,
    on_complete: Callable[..., Any] | str | None = None,
    context: Any = None,
    parent: Timer | int | None = None,
    debounce: timedelta | None = None,
    max_wait: timedelta | None = None,
) -> Timer:
    """Schedule a ``@durable.handler`` to run at ``at``, after ``delay``, or now.

    Written in the caller's transaction on ``DURABLE["DATABASE"]``. With ``key``, an
    existing timer with that key is returned unchanged and nothing is written, even if
    it targets another handler; a key holds while its row exists (pruned rows free it:
    ``RETENTION_DAYS``, ``FAILED_RETENTION_DAYS``). Under a cancelled ``parent`` the
    timer is created cancelled. Bad input raises before any write, naming the argument.

    With ``debounce`` (and ``key``): due at now + ``debounce``; while that timer is
    pending, each later call with the key moves it to its own now + ``debounce`` (never
    earlier, never past the first call + ``max_wait``) and the last call's arguments
    win. Returns the timer as it now stands: a moved timer has a new id.
    """
    options = {
        "args": args,
        "kwargs": kwargs,
        "at": at,
        "delay": delay,
        "key": key,
        "max_attempts": max_attempts,
        "backoff": backoff,
        "on_complete": on_complete,
        "context": context,
        "parent": parent,
        "debounce": debounce,
        "max_wait": max_wait,
    }
    conf = get_settings()
    now_ms = current_clock().now_ms()
    planner = _Planner(conf, now_ms)
    policy = debouncing.check(options, now_ms)
    if policy is not None:
        return _schedule_debounced(planner, fn_or_dotted_name, options, policy)
    timer = planner.plan(fn_or_dotted_name, options, "")
    planner.check_parents()
    db = conf.DATABASE
    if timer.parent_id is None:
        # No parent to lock and check: the insert and its NOTIFY, one statement on
        # PostgreSQL (storage.single), in the caller's transaction.
        return single.insert_announced(db, timer, conf, now_ms)[0]
    with transaction.atomic(using=db, savepoint=False):
        born = parents.cancel_if_parent_canceled(db, [timer])  # born cancelled: see there
        timer, created = store.insert_timer(db, timer)
        if created:
            store.announce(db, [timer], now_ms)
            parents.follow_up_born_canceled(db, born, now_ms)
    return timer


def _schedule_debounced(
    planner: _Planner, target: Any, options: dict[str, Any], policy: debouncing.DebouncePolicy
) -> Timer:
    timer = planner.plan(target, {**options, "delay": policy.debounce}, "")
    db = planner.conf.DATABASE
    with transaction.atomic(using=db, savepoint=False):
        done = debounce_store.debounce(
            db,
            timer,
            debounce_ms=policy.debounce_ms,
            max_wait_ms=policy.max_wait_ms,
            now_ms=planner.now_ms,
        )
    # A refusal raises out here: inside a savepoint-less atomic block it would doom the
    # caller's whole transaction (and the storage wrote nothing for it).
    return debouncing.timer_or_raise(done, str(timer.key))


def schedule_many(specs: Iterable[dict[str, Any]]) -> list[Timer]:
    """Schedule many timers with one INSERT; return them in input order.

    Each spec is a dict of :func:`schedule`'s keyword arguments plus ``"fn"``. All specs
    are validated before anything is written (errors name the spec: ``specs[12].args[0]``).
    Specs whose key exists return the existing timer; a key repeated within the call is a
    ``ValueError``.
    """
    conf = get_settings()
    now_ms = current_clock().now_ms()
    planner = _Planner(conf, now_ms)
    db = conf.DATABASE
    with paused_gc():
        planned, keys = _plan_all(planner, specs)
    planner.check_parents()
    with transaction.atomic(using=db, savepoint=False):
        existing = store.by_keys(db, keys) if keys else {}
        new = [t for t in planned if t.key is None or t.key not in existing]
        born = parents.cancel_if_parent_canceled(db, new)  # born cancelled: see there
        inserted = iter(store.insert_many(db, new))
        store.announce(db, new, now_ms, per_shard=True)
        parents.follow_up_born_canceled(db, born, now_ms)
    return [existing[t.key] if t.key in existing else next(inserted) for t in planned]


def _plan_all(planner: _Planner, specs: Iterable[dict[str, Any]]) -> tuple[list[Timer], set[str]]:
    planned: list[Timer] = []
    first_index: dict[str, int] = {}
    for index, spec in enumerate(specs):
        where = f"specs[{index}]"
        timer = planner.plan(_spec_target(spec, where), spec, where)
        if timer.key is not None:
            if timer.key in first_index:
                raise ValueError(
                    f"{where}.key: {timer.key!r} repeats specs[{first_index[timer.key]}].key"
                )
            first_index[timer.key] = index
        planned.append(timer)
    return planned, set(first_index)


def cancel(timer_or_id: Timer | int) -> bool:
    """Cancel a pending timer and its pending children (recursively); True if this call did.

    False when the timer does not exist, already fired, failed, was cancelled, or is
    being fired right now. Each cancelled timer with ``on_complete`` gets its follow-up
    with ``result={"status": "canceled"}``. Runs in the caller's transaction.
    """
    timer_id = _timer_id(timer_or_id, "timer_or_id")
    conf = get_settings()
    return store.cancel_cascade(conf.DATABASE, timer_id, current_clock().now_ms())


def _spec_target(spec: Any, where: str) -> Any:
    if not isinstance(spec, dict):
        raise TypeError(f"{where}: expected a dict of schedule() arguments, got {spec!r}")
    if not SPEC_KEYS.issuperset(spec):  # no set built per spec on the happy path
        if "debounce" in spec or "max_wait" in spec:
            raise TypeError(f"{where}: schedule_many() does not debounce; call schedule()")
        unknown = sorted(set(spec) - SPEC_KEYS, key=str)
        raise TypeError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}")
    if "fn" not in spec:
        raise TypeError(f"{where}: missing 'fn' (the handler or its dotted name)")
    return spec["fn"]


def _timer_id(value: Any, name: str) -> int:
    if isinstance(value, Timer):
        if value.pk is None:
            raise TimerError(f"{name}: this Timer is not saved (it has no id)")
        return int(value.pk)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a Timer or its id, got {type(value).__name__}")
    return value


class _Planner:
    """Turns validated ``schedule()`` arguments into unsaved ``Timer`` rows.

    One per call: it holds the call's single clock reading, caches handler lookups (a
    ``schedule_many`` of 100k timers usually names one or two handlers) and collects
    parent ids so they are checked with one query.
    """

    def __init__(self, conf: DurableSettings, now_ms: int) -> None:
        self.conf = conf
        self.now_ms = now_ms
        self._specs: dict[Any, HandlerSpec] = {}
        self._parents: dict[int, str] = {}
        self._defaults = (conf.MAX_ATTEMPTS, conf.BACKOFF_BASE_S, conf.BACKOFF_MAX_S)

    def plan(self, target: Any, options: dict[str, Any], where: str) -> Timer:
        """Validate one timer's arguments (``schedule()``'s keywords) and return it, unsaved."""
        conf = self.conf
        get = options.get
        spec = self.handler(target, v.label(where, "fn") if where else "fn_or_dotted_name")
        fire_at_ms = v.fire_at_ms(get("at"), get("delay"), self.now_ms, where)
        key = v.check_key(get("key"), where)
        context = get("context")
        args, kwargs = v.check_payload(
            get("args", ()), get("kwargs"), context, conf.MAX_PAYLOAD_BYTES, where
        )
        self.check_call(spec, args, kwargs, where)
        max_attempts, base_s, max_s = self.policy(spec, get("max_attempts"), get("backoff"), where)
        on_complete = get("on_complete")
        if on_complete is not None:
            follow = self.handler(on_complete, v.label(where, "on_complete"))
            # The follow-up is called with these keywords (storage.timers.create_followup).
            self.check_call(follow, [], FOLLOWUP_KWARGS, where, "on_complete")
            on_complete = follow.name
        parent = get("parent")
        limit = spec.concurrency
        return store.new_pending(
            conf,
            fire_at_ms=fire_at_ms,
            kind=TimerKind.HANDLER,
            target=spec.name,
            args=args,
            kwargs=kwargs,
            key=key,
            max_attempts=max_attempts,
            backoff_base_s=base_s,
            backoff_max_s=max_s,
            parent_id=None if parent is None else self.parent_id(parent, where),
            on_complete=on_complete or "",
            context=context,
            concurrency_key=None if limit is None else limit.key_for(spec.name, args, kwargs),
        )

    def check_call(
        self,
        spec: HandlerSpec,
        args: list[Any],
        kwargs: dict[str, Any],
        where: str,
        name: str = "",
    ) -> None:
        """Raise ``TypeError`` if the handler cannot be called with ``args``/``kwargs``,
        which would otherwise fail every attempt in the worker."""
        v.check_binds(_shape(spec.fn), f"handler {spec.name}", args, kwargs, where, name)

    def policy(
        self, spec: HandlerSpec, max_attempts: Any, backoff: Any, where: str
    ) -> tuple[int, float, float]:
        """Return ``(max_attempts, backoff base_s, max_s)``: call over handler over settings."""
        conf = self.conf
        overrides = (max_attempts, backoff, spec.max_attempts, spec.backoff)
        if overrides == (None, None, None, None):
            return self._defaults  # the common case, without building anything
        max_attempts = v.check_max_attempts(max_attempts, where)
        policy = v.to_backoff(backoff, conf.BACKOFF_MAX_S, where) or spec.backoff
        return (
            max_attempts or spec.max_attempts or conf.MAX_ATTEMPTS,
            policy.base_s if policy else conf.BACKOFF_BASE_S,
            policy.max_s if policy else conf.BACKOFF_MAX_S,
        )

    def handler(self, target: Any, name: str) -> HandlerSpec:
        """Return the registered spec for a handler function or dotted name."""
        if not isinstance(target, str | FunctionType):
            return _resolve(target, name)  # maybe unhashable: not cached
        spec = self._specs.get(target)
        if spec is None:
            spec = self._specs[target] = _resolve(target, name)
        return spec

    def parent_id(self, parent: Any, where: str) -> int:
        """Return the parent's id, remembered for :meth:`check_parents`."""
        name = v.label(where, "parent")
        parent_id = _timer_id(parent, name)
        self._parents.setdefault(parent_id, name)
        return parent_id

    def check_parents(self) -> None:
        """Raise :class:`TimerError` naming the first parent that is not a timer."""
        if not self._parents:
            return
        missing = store.missing_ids(self.conf.DATABASE, self._parents)
        if missing:
            parent_id = min(missing)
            raise TimerError(
                f"{self._parents[parent_id]}: no timer with id {parent_id}", parent=parent_id
            )


#: Handlers' call shapes, read once per function: ``inspect.signature`` cost more than the
#: rest of planning a timer, and a planner lives for one call. Weak: a handler registered
#: anew (tests, reloads) drops its old function's entry.
_SHAPES: weakref.WeakKeyDictionary[Any, v.CallShape] = weakref.WeakKeyDictionary()


def _shape(fn: Any) -> v.CallShape:
    try:
        return _SHAPES[fn]
    except KeyError:
        pass
    except TypeError:  # no weak reference to it: read it every time
        return v.call_shape(fn)
    shape = _SHAPES[fn] = v.call_shape(fn)
    return shape


def _resolve(target: Any, name: str) -> HandlerSpec:
    if isinstance(target, str):
        if handlers.get(target) is None:
            _import_owner(target)
        try:
            return handlers.resolve(target)
        except UnknownHandler as exc:
            raise UnknownHandler(f"{name}: {exc}", handler=target) from None
    if not callable(target):
        raise TypeError(
            f"{name}: expected a @durable.handler function or its dotted name, "
            f"got {type(target).__name__}"
        )
    try:
        dotted = handler_name(target)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    spec = handlers.get(dotted)
    if spec is None:
        raise UnknownHandler(
            f"{name}: {dotted} is not a durable handler; decorate it with @durable.handler",
            handler=dotted,
        )
    return spec


def _import_owner(dotted: str) -> None:
    """Import the module a dotted handler name lives in (its longest importable prefix).

    Only for names the caller passes to ``schedule()``: that is code, like an import
    statement, so importing it to find its ``@durable.handler`` is fine. The worker never
    does this with a row's target; it only looks names up.
    """
    module_name = dotted
    while "." in module_name:
        module_name = module_name.rsplit(".", 1)[0]
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue
        return
