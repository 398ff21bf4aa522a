"""The built sdist and wheel hold every file of the ``durable`` package, templates included.

An installed wheel without ``durable/templates`` answers 500 ``TemplateDoesNotExist`` on
the admin's overview, lease list and every timer and run page (issue 14), and the suite,
which runs from the source tree, never notices. This test builds both distributions the
way ``python -m build`` does (sdist first, then the wheel from the unpacked sdist) and
compares them with the source tree.

The build runs on a copy of the checkout: setuptools reuses ``build/lib`` and an old
``*.egg-info/SOURCES.txt`` left in the tree, which could supply a file that the
packaging configuration no longer includes. It runs ``--no-isolation`` with the dev
extras' ``build`` and ``setuptools``, so it needs no network. ``scripts/wheel_smoke.sh``
goes further: it installs the wheel in a fresh virtualenv and drives a new project.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "durable"


def _can_build() -> str | None:
    """Why the distributions cannot be built here, or None if they can."""
    try:
        setuptools_major = int(version("setuptools").split(".")[0])
        version("build")
    except PackageNotFoundError as missing:
        return f"{missing} is not installed (it is in the dev extras: pip install -e '.[dev]')"
    if setuptools_major < 77:
        return f"setuptools {version('setuptools')} < 77, which pyproject.toml's build needs"
    return None


def _package_files() -> set[str]:
    """Every file of the package in the source tree, as ``durable/...`` paths."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], set[str]]:
    """Names in the built wheel and in the sdist (sdist names without their top folder)."""
    reason = _can_build()
    if reason:
        pytest.skip(f"cannot build the distributions: {reason}")
    tmp = tmp_path_factory.mktemp("packaging")
    source, out = tmp / "src", tmp / "dist"
    # The checkout's top-level files (pyproject.toml, README.md, LICENSE, MANIFEST.in...)
    # and the package; not its build/, *.egg-info, caches or virtualenvs.
    source.mkdir()
    for path in ROOT.iterdir():
        if path.is_file() and not path.name.startswith(".") and ".sqlite3" not in path.name:
            shutil.copy2(path, source / path.name)
    shutil.copytree(PACKAGE, source / "durable", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        wheel_names = set(archive.namelist())
    with tarfile.open(sdist) as archive:
        sdist_names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    return wheel_names, sdist_names


def test_the_package_has_templates_to_check():
    templates = [name for name in _package_files() if name.startswith("durable/templates/")]
    assert "durable/templates/admin/durable/overview.html" in templates
    assert len(templates) >= 6, templates


def test_the_wheel_holds_every_package_file(dists):
    wheel_names, _ = dists
    missing = sorted(_package_files() - wheel_names)
    assert not missing, f"not in the wheel (add them to [tool.setuptools.package-data]): {missing}"


def test_the_wheel_holds_nothing_but_the_package(dists):
    wheel_names, _ = dists
    package = {name for name in wheel_names if ".dist-info/" not in name}
    assert package == _package_files()


def test_the_sdist_holds_every_package_file_and_the_build_files(dists):
    _, sdist_names = dists
    missing = sorted(_package_files() - sdist_names)
    assert not missing, f"not in the sdist (package-data or MANIFEST.in): {missing}"
    assert {"pyproject.toml", "README.md", "LICENSE"} <= sdist_names
