"""STYLE.md: modules stay under 400 lines; a module past it is split along its seams."""

from __future__ import annotations

from pathlib import Path

import durable

LIMIT = 400
PACKAGE = Path(durable.__file__).resolve().parent
CHAOS = PACKAGE.parent / "chaos"  # the chaos run (make chaos) is code CI runs too

EXEMPT: set[str] = set()  # none: a module past the limit is split, not excused


def oversized(root: Path, limit: int, exempt: set[str]) -> list[str]:
    """``path: lines`` of every ``.py`` file under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in exempt:
            continue
        with path.open(encoding="utf-8") as handle:
            lines = sum(1 for _ in handle)
        if lines > limit:
            found.append(f"{root.name}/{name}: {lines} lines")
    return found


def test_every_module_is_under_the_limit():
    offenders = oversized(PACKAGE, LIMIT, EXEMPT)
    if CHAOS.is_dir():  # a source checkout (the installed wheel ships durable/ alone)
        offenders += oversized(CHAOS, LIMIT, set())
    assert not offenders, (
        f"modules over {LIMIT} lines (STYLE.md; split them along their seams): "
        + ", ".join(offenders)
    )


def test_the_exempt_modules_exist():
    # An exemption for a file that was renamed or removed would hide nothing and linger.
    for name in EXEMPT:
        assert (PACKAGE / name).is_file(), name


def test_the_check_finds_a_long_module(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * LIMIT)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "sub" / "skipped.py").write_text("x = 1\n" * (LIMIT + 5))
    found = oversized(tmp_path, LIMIT, {"sub/skipped.py"})
    assert found == [f"{tmp_path.name}/sub/long.py: 401 lines"]
