"""The package's import graph has no circle through the app config.

``durable.apps`` imports the checks and the kinds (scheduling, workflows, tasks) when
Django calls ``ready()``; so nothing in the package may import ``durable.apps`` back. The
clock every layer reads lives in ``durable.core.clock`` for that reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import durable

PACKAGE = Path(durable.__file__).parent


def _imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_nothing_in_the_package_imports_the_app_config() -> None:
    offenders = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "apps.py" and "durable.apps" in _imports_of(path)
    )
    assert offenders == [], f"these modules import durable.apps: {offenders}"


def test_the_clock_can_be_swapped_without_django() -> None:
    from durable.core.clock import current_clock, install_clock
    from durable.testing import ManualClock

    clock = ManualClock(start_ms=42)
    previous = install_clock(clock)
    try:
        assert current_clock().now_ms() == 42
    finally:
        install_clock(previous)
    assert current_clock() is previous
