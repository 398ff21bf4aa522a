"""@durable.handler: registration, validation at decoration time, and scheduling by it."""

from __future__ import annotations

import importlib
import textwrap
from datetime import timedelta

import pytest
from django.test.utils import override_settings

import durable
from durable.dispatch.registry import handlers
from durable.exceptions import UnknownHandler
from durable.models import Timer

HERE = __name__


@durable.handler
def plain(x: int) -> int:
    """A bare-decorated handler."""
    return x * 2


@durable.handler(atomic=False, max_attempts=5, backoff=timedelta(seconds=30))
def external(url: str) -> None:
    """A non-atomic handler with its own retry policy."""


@durable.handler(backoff=durable.Backoff(base_s=0.5, max_s=8.0))
def tuned() -> None:
    """A handler with an explicit Backoff."""


def test_bare_decorator_registers_and_returns_the_function_unchanged():
    assert plain(21) == 42  # still callable directly
    spec = handlers.get(f"{HERE}.plain")
    assert spec is not None and spec.fn is plain
    assert (spec.atomic, spec.max_attempts, spec.backoff) == (True, None, None)


def test_options_are_recorded_in_the_spec():
    spec = handlers.get(f"{HERE}.external")
    assert spec.fn is external and spec.atomic is False and spec.max_attempts == 5
    assert spec.backoff == durable.Backoff(base_s=30.0, max_s=3600.0)
    assert handlers.get(f"{HERE}.tuned").backoff == durable.Backoff(base_s=0.5, max_s=8.0)


def test_timedelta_backoff_is_capped_by_settings(tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch, "durable_capped_probe", "def job():\n    pass\n")
    with override_settings(DURABLE={"BACKOFF_MAX_S": 120.0}):
        durable.handler(backoff=timedelta(seconds=4))(module.job)
    assert handlers.get("durable_capped_probe.job").backoff == durable.Backoff(
        base_s=4.0, max_s=120.0
    )


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"max_attempts": 0}, ValueError, r"^max_attempts: must be >= 1, got 0"),
        ({"max_attempts": "3"}, TypeError, r"^max_attempts: expected an int >= 1, got str"),
        ({"max_attempts": True}, TypeError, r"^max_attempts: expected an int >= 1, got bool"),
        ({"backoff": 5}, TypeError, r"^backoff: expected a durable\.Backoff or a timedelta"),
        ({"backoff": timedelta(0)}, ValueError, r"^backoff: the base delay must be positive"),
        ({"backoff": timedelta(hours=2)}, ValueError, r"^backoff: .* exceeds .*BACKOFF_MAX_S"),
        ({"atomic": "yes"}, TypeError, r"^atomic: expected True or False, got str"),
    ],
)
def test_bad_options_fail_at_decoration_naming_the_argument(options, error, message):
    before = handlers.names()
    with pytest.raises(error, match=message):
        durable.handler(**options)
    assert handlers.names() == before


def test_local_functions_and_lambdas_are_refused():
    def local() -> None:
        pass

    before = handlers.names()
    with pytest.raises(TypeError, match="define handlers at module level"):
        durable.handler(local)
    with pytest.raises(TypeError, match="define handlers at module level"):
        durable.handler(lambda: None)
    assert handlers.names() == before


def test_non_functions_are_refused():
    class Job:
        pass

    with pytest.raises(TypeError, match="decorates module-level functions, got type"):
        durable.handler(Job)
    with pytest.raises(TypeError, match=r"did you mean @durable\.handler"):
        durable.handler(5)


def test_async_functions_are_refused(tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch, "durable_async_probe", "async def job():\n    pass\n")
    with pytest.raises(TypeError, match="'job' is async; handlers must be sync functions"):
        durable.handler(module.job)


def test_decorating_again_replaces_the_policy(tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch, "durable_redecorate_probe", "def job():\n    pass\n")
    durable.handler(module.job)
    durable.handler(max_attempts=2)(module.job)
    assert handlers.get("durable_redecorate_probe.job").max_attempts == 2


@pytest.mark.django_db
def test_scheduling_uses_the_handlers_policy():
    timer = durable.schedule(external, args=["https://example.com"])
    assert timer.target == f"{HERE}.external"
    assert (timer.max_attempts, timer.backoff_base_s, timer.backoff_max_s) == (5, 30.0, 3600.0)
    by_name = durable.schedule(f"{HERE}.tuned")
    assert (by_name.backoff_base_s, by_name.backoff_max_s) == (0.5, 8.0)


@pytest.mark.django_db
def test_a_dotted_name_imports_the_handlers_module(tmp_path, monkeypatch):
    source = "import durable\n\n@durable.handler(max_attempts=4)\ndef remind(user):\n    pass\n"
    (tmp_path / "durable_lazy_probe.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert handlers.get("durable_lazy_probe.remind") is None  # not imported yet
    timer = durable.schedule("durable_lazy_probe.remind", args=[7])
    assert timer.max_attempts == 4
    assert Timer.objects.filter(target="durable_lazy_probe.remind").count() == 1


@pytest.mark.django_db
def test_an_undecorated_function_must_be_decorated_first(tmp_path, monkeypatch):
    module = _module(tmp_path, monkeypatch, "durable_bare_probe", "def job():\n    pass\n")
    with pytest.raises(UnknownHandler, match=r"durable_bare_probe\.job is not a durable handler"):
        durable.schedule(module.job)
    with pytest.raises(UnknownHandler, match=r"unknown handler 'durable_bare_probe\.job'"):
        durable.schedule("durable_bare_probe.job")
    assert not Timer.objects.exists()


def _module(tmp_path, monkeypatch, name: str, source: str):
    """Write and import a throwaway module, so its functions have a module-level name."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)
