"""Two versions of a workflow module, for the deploy-safety tests of ``durable_check_runs``.

:func:`install` registers version 1 or 2 under stable names, as importing that version
of the module in a fresh process would (registering a name again replaces it). Version 2
adds a step under ``ctx.patched`` (safe), swaps two steps of ``reordered`` (breaks the
runs that already recorded them) and renames ``invoices`` (breaks all of its runs).
"""

from __future__ import annotations

from datetime import timedelta

import durable
from durable.workflows.registry import workflows

DAY = timedelta(days=1)
NAMES = ("deploy.sleeper", "deploy.waiter", "deploy.patched", "deploy.reordered")
OLD_NAME, NEW_NAME = "deploy.invoices", "deploy.invoices_v2"


def step(label: str) -> str:
    return label


# -- version 1 ---------------------------------------------------------------------------


def sleeper(ctx, n):
    ctx.step(step, f"a{n}")
    ctx.sleep(DAY)
    return ctx.step(step, f"b{n}")


def waiter(ctx, n):
    ctx.step(step, f"a{n}")
    payload = ctx.wait_for_signal("go")
    return ctx.step(step, f"{payload}{n}")


def patched_v1(ctx, n):
    ctx.step(step, f"a{n}")
    ctx.sleep(DAY)
    return ctx.step(step, f"b{n}")


def reordered_v1(ctx, n):
    ctx.step(step, f"a{n}")
    ctx.sleep(DAY)
    ctx.step(step, f"b{n}")
    ctx.options(name="c").step(step, f"c{n}")
    ctx.sleep(DAY)
    return ctx.step(step, f"d{n}")


def invoices(ctx, n):
    ctx.step(step, f"a{n}")
    ctx.sleep(DAY)
    return n


# -- version 2 ---------------------------------------------------------------------------


def extra(n: int) -> str:
    return f"extra{n}"


def patched_v2(ctx, n):
    ctx.step(step, f"a{n}")
    if ctx.patched("extra-step"):  # runs recorded before the change keep the old path
        ctx.step(extra, n)
    ctx.sleep(DAY)
    return ctx.step(step, f"b{n}")


def reordered_v2(ctx, n):
    ctx.step(step, f"a{n}")
    ctx.sleep(DAY)
    ctx.options(name="c").step(step, f"c{n}")  # swapped with b: a breaking change
    ctx.step(step, f"b{n}")
    ctx.sleep(DAY)
    return ctx.step(step, f"d{n}")


def install(version: int) -> None:
    """Register the workflows of module version ``version`` (1 or 2)."""
    for name, fn in (("deploy.sleeper", sleeper), ("deploy.waiter", waiter)):
        durable.workflow(name=name)(fn)
    if version == 1:
        durable.workflow(name="deploy.patched")(patched_v1)
        durable.workflow(name="deploy.reordered")(reordered_v1)
        durable.workflow(name=OLD_NAME)(invoices)
    else:
        durable.workflow(name="deploy.patched")(patched_v2)
        durable.workflow(name="deploy.reordered")(reordered_v2)
        durable.workflow(name=NEW_NAME)(invoices)
        workflows._defs.pop(OLD_NAME, None)  # the new process never imports the old name


def uninstall() -> None:
    """Forget every name :func:`install` registered (test cleanup)."""
    for name in (*NAMES, OLD_NAME, NEW_NAME):
        workflows._defs.pop(name, None)
