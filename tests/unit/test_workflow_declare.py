"""Declaring workflows: shapes, names, and errors at declaration and start time."""

from __future__ import annotations

import sys

import pytest

import durable
from durable.exceptions import PayloadError, UnknownWorkflow, WorkflowError
from durable.workflows import Workflow, workflows
from durable.workflows.registry import CLASS, FUNCTION, METHOD, WorkflowDef
from testproject.demo.models import Order


@durable.workflow
def plain(ctx, order_id: int, *, express: bool = False):
    return order_id


class Checkout(Workflow):
    max_attempts = 2

    def run(self, ctx, cart):
        return cart


class Base(Workflow, abstract=True):
    def helper(self):
        return 1


def test_the_three_shapes_register_under_dotted_names():
    assert isinstance(plain, WorkflowDef) and plain.shape == FUNCTION
    assert plain.name == "tests.unit.test_workflow_declare.plain"
    assert workflows.resolve(plain.name) is plain
    assert Checkout.definition.shape == CLASS and Checkout.name.endswith(".Checkout")
    assert Checkout.definition.policy().max_attempts == 2
    assert Order.fulfil.shape == METHOD and Order.fulfil.model is Order
    assert Order.fulfil.name == "testproject.demo.models.Order.fulfil"
    assert plain.__doc__ is None and Order.fulfil.__doc__.startswith("Reserve, charge")
    assert not hasattr(Base, "definition")


def test_calling_a_workflow_directly_says_how_to_start_it():
    with pytest.raises(TypeError, match=r"start it with \.start"):
        plain(None, 1)
    with pytest.raises(TypeError, match=r"use \.start"):
        Order(pk=1).fulfil()


@pytest.mark.parametrize(
    ("decorate", "message"),
    [
        (lambda: durable.workflow(lambda ctx: 1), "not importable by name"),
        (lambda: durable.workflow(print), "decorates functions"),
        (lambda: durable.workflow(max_attempts=0)(plain.fn), "max_attempts"),
        (lambda: durable.workflow(strict="yes")(plain.fn), "strict"),
        (lambda: durable.workflow(name="")(plain.fn), "name"),
    ],
)
def test_bad_declarations_fail_at_once(decorate, message):
    with pytest.raises((TypeError, ValueError), match=message):
        decorate()


def test_bad_function_shapes_fail_at_once():
    async def coroutine(ctx):
        return 1

    def generator(ctx):
        yield 1

    def no_ctx():
        return 1

    for fn, message in ((coroutine, "plain"), (generator, "plain"), (no_ctx, r"\(ctx, ...\)")):
        with pytest.raises(TypeError, match=message):
            durable.workflow(name=f"x.{fn.__name__}")(fn)
    with pytest.raises(TypeError, match=r"must define run"):

        class NoRun(Workflow):
            pass


def test_a_method_workflow_needs_a_model():
    with pytest.raises((TypeError, RuntimeError)) as info:

        class NotAModel:
            @durable.workflow(name="tests.not_a_model.process")
            def process(self, ctx):
                return 1

    error = info.value if isinstance(info.value, TypeError) else info.value.__cause__
    assert "only on Django models" in str(error)


def test_start_checks_everything_before_writing():
    with pytest.raises(TypeError, match=r"from a saved instance"):
        Order.fulfil.start()
    with pytest.raises(WorkflowError, match=r"Order is not saved"):
        Order(customer="a", total_cents=1).fulfil.start()
    with pytest.raises(WorkflowError, match=r"not saved"):
        Order(pk=5, customer="a", total_cents=1).fulfil.start()
    with pytest.raises(TypeError, match=r"plain: missing a required argument: 'order_id'"):
        plain.start()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'fast'"):
        plain.start(1, fast=True)
    with pytest.raises(PayloadError, match=r"args\[0\]\['when'\]: object is not JSON"):
        plain.start({"when": object()})
    for bad in ("", "a:b", "has space", "x" * 101, 7):
        with pytest.raises((ValueError, TypeError), match="run_id"):
            plain.start(1, run_id=bad)


def test_an_unknown_workflow_is_a_clear_error_and_nothing_is_imported(tmp_path, monkeypatch):
    with pytest.raises(UnknownWorkflow, match=r"unknown workflow 'nowhere\.gone'.*renamed"):
        workflows.resolve("nowhere.gone")
    # A run's name is row data: resolving it must not import the module it names.
    (tmp_path / "wf_unimported_module.py").write_text("raise RuntimeError('imported!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownWorkflow, match=r"not registered.*DURABLE\['IMPORTS'\]"):
        workflows.resolve("wf_unimported_module.flow")
    assert "wf_unimported_module" not in sys.modules


def test_a_bound_workflow_knows_its_row():
    # (No model is declared in this module: makemigrations --check would see it.)
    order = Order(pk=3)
    bound = order.fulfil
    assert bound.definition is Order.fulfil and bound.instance is order
    assert "Order.fulfil" in repr(bound)


def _key(account, n):
    return account


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"concurrency_key": "acme"}, TypeError, "concurrency_key goes with max_concurrency"),
        ({"max_concurrency": 2}, TypeError, "concurrency_key goes with max_concurrency"),
        ({"concurrency_key": _key, "max_concurrency": 0}, ValueError, "max_concurrency: must"),
        ({"concurrency_key": _key, "max_concurrency": "2"}, TypeError, "max_concurrency: expe"),
        ({"concurrency_key": 5, "max_concurrency": 2}, TypeError, "workflow's arguments"),
        ({"concurrency_key": "", "max_concurrency": 2}, ValueError, "concurrency_key: the fix"),
        ({"concurrency_key": "a", "rate_limit": "10/d"}, ValueError, "rate_limit"),
    ],
)
def test_bad_limits_fail_at_declaration_naming_the_option(options, error, message):
    def limited(ctx, account, n): ...

    limited.__qualname__ = "limited"  # importable-looking: only the limits are wrong
    with pytest.raises(error, match=message):
        durable.workflow(**options)(limited)


def test_a_limited_workflow_keeps_its_policy_and_a_class_one_too():
    def limited(ctx, account, n): ...

    limited.__qualname__ = "limited_ok"
    definition = durable.workflow(concurrency_key=_key, max_concurrency=3)(limited)
    assert definition.concurrency is not None and definition.concurrency.max_concurrency == 3
    assert workflows.limited

    class PerAccount(Workflow):
        name = "tests.unit.test_workflow_declare.PerAccount"
        concurrency_key = staticmethod(_key)
        max_concurrency = 1

        def run(self, ctx, account, n): ...

    assert PerAccount.definition.concurrency is not None
    assert PerAccount.definition.concurrency.key is _key
