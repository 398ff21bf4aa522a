"""Declaring workflows: ``@durable.workflow``, ``durable.Workflow`` and the registry.

Three shapes, one :class:`WorkflowDef` each, registered under a dotted name
(``"<module>.<qualname>"`` unless ``name=`` is given) that the run row stores:

- a module-level function ``fn(ctx, ...)``: ``fn.start(...)``;
- a method of a Django model ``def process(self, ctx, ...)``: ``order.process.start(...)``
  binds the run to that row (model label + primary key), and each replay loads the row
  afresh as ``self``;
- a ``durable.Workflow`` subclass with ``run(self, ctx, ...)``: ``Checkout.start(...)``.

Everything a start needs is checked when it is called, before any write: the arguments
must bind to the code's signature and be JSON (the error names the path), the bound row
must be saved, the run id well formed.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, overload

from django.db import models

from durable.conf import get_settings
from durable.core.backoff import Backoff
from durable.dispatch.concurrency import ConcurrencyPolicy, policy
from durable.dispatch.registry import WHERE_TO_REGISTER
from durable.exceptions import UnknownWorkflow
from durable.scheduling.validation import check_max_attempts, check_text, to_backoff
from durable.workflows.records import StepPolicy

if TYPE_CHECKING:
    from durable.models import WorkflowRun

FUNCTION, METHOD, CLASS = "function", "method", "class"


class WorkflowDef:
    """A registered workflow: its name, code, shape and step retry policy.

    ``@durable.workflow`` returns one. On a model it is a descriptor: ``Order.process``
    is the definition, ``order.process`` a :class:`BoundWorkflow` for that row.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        shape: str,
        strict: bool,
        max_attempts: int | None,
        backoff: Backoff | None,
        concurrency: ConcurrencyPolicy | None = None,
    ) -> None:
        self.fn = fn
        self.name = name
        self.shape = shape
        self.strict = strict
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.concurrency = concurrency
        """Its limits per key, or ``None``: see :mod:`durable.workflows.slots`."""
        self.model: type[models.Model] | None = None
        self.owner: type | None = None
        self.signature = inspect.signature(fn)
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"<workflow {self.name} ({self.shape})>"

    def __set_name__(self, owner: type, attr: str) -> None:
        if not (isinstance(owner, type) and issubclass(owner, models.Model)):
            raise TypeError(
                f"@durable.workflow on {owner.__name__}.{attr}: methods can be workflows "
                "only on Django models (the run is bound to a saved row)"
            )
        self.shape = METHOD
        self.model = owner

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> WorkflowDef: ...
    @overload
    def __get__(self, instance: models.Model, owner: type | None = None) -> BoundWorkflow: ...
    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return BoundWorkflow(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.name} is a durable workflow: start it with .start(...)")

    def policy(self) -> StepPolicy:
        """The step retry policy: this workflow's options over the settings."""
        conf = get_settings()
        return StepPolicy(
            max_attempts=self.max_attempts or conf.MAX_ATTEMPTS,
            backoff=self.backoff or Backoff(base_s=conf.BACKOFF_BASE_S, max_s=conf.BACKOFF_MAX_S),
            max_steps=conf.MAX_STEPS_PER_RUN,
        )

    def invoke(self, ctx: Any, instance: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Call the workflow code (the executor's entry point)."""
        if self.shape == FUNCTION:
            return self.fn(ctx, *args, **kwargs)
        if self.shape == CLASS:
            assert self.owner is not None
            instance = self.owner()
        return self.fn(instance, ctx, *args, **kwargs)

    def check_call(self, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise ``TypeError`` if ``args``/``kwargs`` do not fit the code's signature."""
        leading: tuple[Any, ...] = (None,) if self.shape == FUNCTION else (instance, None)
        try:
            self.signature.bind(*leading, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from None

    def start(self, *args: Any, run_id: str | None = None, **kwargs: Any) -> WorkflowRun:
        """Start a run in the caller's transaction and return its ``WorkflowRun``.

        ``run_id`` makes the start idempotent: if a run with that id exists it is
        returned unchanged and nothing is written. A finished run is kept (and its id
        taken) for ``RUN_RETENTION_DAYS``; after that the id starts a new run.
        """
        if self.shape == METHOD:
            raise TypeError(
                f"{self.name} is bound to a model row: start it from a saved instance, "
                f"e.g. instance.{self.__name__}.start(...)"
            )
        from durable.workflows.start import start_run

        return start_run(self, None, args, kwargs, run_id)

    def start_many(self, calls: Iterable[dict[str, Any]]) -> list[WorkflowRun]:
        """Start many runs with one INSERT for the runs and one for their timers.

        Each call is a dict with optional ``args``, ``kwargs``, ``run_id`` and, for a
        model-method workflow, ``instance``. Runs are returned in input order; a
        ``run_id`` that exists returns the existing run.
        """
        from durable.workflows.start import start_many

        return start_many(self, calls)


class BoundWorkflow:
    """A model-method workflow bound to one row: ``order.process``."""

    __slots__ = ("definition", "instance")

    def __init__(self, definition: WorkflowDef, instance: models.Model) -> None:
        self.definition = definition
        self.instance = instance

    def __repr__(self) -> str:
        return f"<workflow {self.definition.name} of {self.instance!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{self.definition.name} is a durable workflow: use .start(...)")

    def start(self, *args: Any, run_id: str | None = None, **kwargs: Any) -> WorkflowRun:
        """Start a run bound to this row (which must be saved); see :meth:`WorkflowDef.start`."""
        from durable.workflows.start import start_run

        return start_run(self.definition, self.instance, args, kwargs, run_id)


class Workflow:
    """Base class for workflows written as classes: define ``run(self, ctx, ...)``.

    Class attributes set options: ``name`` (registered name), ``strict``,
    ``max_attempts`` and ``backoff`` (step retries), ``concurrency_key``,
    ``max_concurrency`` and ``rate_limit`` (as for ``@durable.workflow``; a callable key
    is a ``staticmethod``). A fresh instance runs each replay,
    so keep state in ctx calls' results, not on ``self``. Pass ``abstract=True`` in the
    class statement for a base class that is not a workflow itself.
    """

    name: ClassVar[str | None] = None
    strict: ClassVar[bool] = False
    max_attempts: ClassVar[int | None] = None
    backoff: ClassVar[Backoff | timedelta | None] = None
    concurrency_key: ClassVar[Any] = None
    max_concurrency: ClassVar[int | None] = None
    rate_limit: ClassVar[str | None] = None
    definition: ClassVar[WorkflowDef]

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if abstract:
            return
        if cls.run is Workflow.run:
            raise TypeError(f"{cls.__qualname__} must define run(self, ctx, ...)")
        definition = _declare(
            cls.run,
            name=cls.__dict__.get("name") or _dotted(cls),
            shape=CLASS,
            strict=cls.strict,
            max_attempts=cls.max_attempts,
            backoff=cls.backoff,
            limits=(cls.concurrency_key, cls.max_concurrency, cls.rate_limit),
        )
        definition.owner = cls
        cls.definition = definition
        cls.name = definition.name

    def run(self, ctx: Any, *args: Any, **kwargs: Any) -> Any:
        """The workflow's code; subclasses define it (checked at class creation)."""
        raise NotImplementedError

    @classmethod
    def start(cls, *args: Any, run_id: str | None = None, **kwargs: Any) -> WorkflowRun:
        """Start a run of this workflow; see :meth:`WorkflowDef.start`."""
        return cls.definition.start(*args, run_id=run_id, **kwargs)

    @classmethod
    def start_many(cls, calls: Iterable[dict[str, Any]]) -> list[WorkflowRun]:
        """Start many runs at once; see :meth:`WorkflowDef.start_many`."""
        return cls.definition.start_many(calls)


@overload
def workflow(fn: Callable[..., Any], /) -> WorkflowDef: ...
@overload
def workflow(
    *,
    name: str | None = None,
    strict: bool = False,
    max_attempts: int | None = None,
    backoff: Backoff | timedelta | None = None,
    concurrency_key: str | Callable[..., str] | None = None,
    max_concurrency: int | None = None,
    rate_limit: str | None = None,
) -> Callable[[Callable[..., Any]], WorkflowDef]: ...
def workflow(
    fn: Any = None,
    /,
    *,
    name: str | None = None,
    strict: bool = False,
    max_attempts: int | None = None,
    backoff: Backoff | timedelta | None = None,
    concurrency_key: str | Callable[..., str] | None = None,
    max_concurrency: int | None = None,
    rate_limit: str | None = None,
) -> Any:
    """Declare a durable workflow: a module-level function ``fn(ctx, ...)`` or a model method.

    Use bare (``@durable.workflow``) or with options: ``name`` (the registered name;
    default ``"<module>.<qualname>"``), ``strict`` (wall-clock time and randomness raise
    in the workflow code), ``max_attempts`` and ``backoff`` (default retry policy of its
    steps). Returns a :class:`WorkflowDef`; start runs with ``.start(...)``.

    ``concurrency_key`` (a ``str``, or a callable given the start's arguments that
    returns one) with ``max_concurrency=N`` and/or ``rate_limit="N/m"``: at most N runs
    of a key in progress at once, from their first replay to their end, sleeps and waits
    included; at most N runs of a key started per period. A run over the limit stays
    pending, in its key's line (see :mod:`durable.workflows.slots`).
    """

    def register(func: Callable[..., Any]) -> WorkflowDef:
        return _declare(
            func,
            name=name,
            shape=METHOD if _looks_like_method(func) else FUNCTION,
            strict=strict,
            max_attempts=max_attempts,
            backoff=backoff,
            limits=(concurrency_key, max_concurrency, rate_limit),
        )

    return register if fn is None else register(fn)


def _declare(
    fn: Any,
    *,
    name: str | None,
    shape: str,
    strict: Any,
    max_attempts: Any,
    backoff: Any,
    limits: tuple[Any, Any, Any] = (None, None, None),
) -> WorkflowDef:
    if not inspect.isfunction(fn):
        raise TypeError(
            f"@durable.workflow decorates functions and model methods, got {fn!r} "
            "(did you mean @durable.workflow(...) with keyword arguments?)"
        )
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
        raise TypeError(f"workflow {fn.__qualname__!r} must be a plain (sync) function")
    if not isinstance(strict, bool):
        raise TypeError(f"strict: expected True or False, got {type(strict).__name__}")
    check_max_attempts(max_attempts)
    # Settings are read only for a backoff: declaring must not need valid settings (a
    # worker with bad ones must reach its checks, which list every problem).
    retry_backoff = (
        to_backoff(backoff, get_settings().BACKOFF_MAX_S) if backoff is not None else None
    )
    concurrency = policy(*limits, owner="workflow")
    if name is not None and (not isinstance(name, str) or not 1 <= len(name) <= 255):
        raise ValueError(f"name: expected 1 to 255 characters, got {name!r}")
    check_text(name, "name")
    wanted = 1 if shape == FUNCTION else 2
    positional = [p for p in inspect.signature(fn).parameters.values() if p.kind in _POSITIONAL]
    if len(positional) < wanted:
        needs = "ctx" if shape == FUNCTION else "self, ctx"
        raise TypeError(f"workflow {fn.__qualname__!r} must take ({needs}, ...)")
    definition = WorkflowDef(
        fn,
        name=name or _dotted(fn),
        shape=shape,
        strict=strict,
        max_attempts=max_attempts,
        backoff=retry_backoff,
        concurrency=concurrency,
    )
    return workflows.register(definition)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _looks_like_method(fn: Any) -> bool:
    # Decided again for sure by __set_name__; this only picks the argument check.
    qualname = fn.__qualname__
    return "." in qualname and not qualname.endswith(f"<locals>.{fn.__name__}")


def _dotted(obj: Any) -> str:
    qualname = obj.__qualname__
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"workflow {qualname!r} is not importable by name: define it at module level "
            "(or in a model class), or give it a name= and import its module at start-up"
        )
    return f"{obj.__module__}.{qualname}"


class WorkflowRegistry:
    """Registered name → :class:`WorkflowDef`. Thread-safe; looking up never imports."""

    def __init__(self) -> None:
        self._defs: dict[str, WorkflowDef] = {}
        self._lock = threading.Lock()
        self.limited = False
        """Whether any registered workflow has a concurrency key (the firer's shortcut)."""

    def register(self, definition: WorkflowDef) -> WorkflowDef:
        """Add ``definition``; registering a name again replaces it (module reloads)."""
        with self._lock:
            self._defs[definition.name] = definition
            self.limited = any(d.concurrency is not None for d in self._defs.values())
        return definition

    def get(self, name: str) -> WorkflowDef | None:
        """The definition registered under ``name``, or ``None`` (no import attempted)."""
        return self._defs.get(name)

    def resolve(self, name: str) -> WorkflowDef:
        """The definition registered under ``name``; nothing is imported.

        A run's name is row data: importing what it names would run that module's
        import-time code. Workflows are registered when their modules are imported at
        start-up (:mod:`durable.discovery`). Raises :class:`UnknownWorkflow` naming the
        workflow when there is none.
        """
        found = self._defs.get(name)
        if found is None:
            raise UnknownWorkflow(
                f"unknown workflow {name!r}: it is not registered (no @durable.workflow or "
                "Workflow subclass of that name was imported in this process: renamed or "
                f"removed?); {WHERE_TO_REGISTER}",
                workflow=name,
            )
        return found

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self._defs)


#: Filled by the decorators at import time, read by the worker (like ``admin.site``).
workflows = WorkflowRegistry()
