"""The timing wheel as it was at an earlier commit, loaded from git for side-by-side runs.

``bench/wheel_boundary.py`` compares the wheel before issue 16's bounded advance (main at
6e4453b: a coarse slot split all at once when time enters it) with ``durable.core.wheel``
in one process. Rather than keep a copy of the old code in the tree, its files are read
with ``git show`` into a temporary package and imported under another name. Needs a git
checkout that has the commit.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
FILES = ("__init__.py", "rings.py", "timing_wheel.py")


def load_wheel(rev: str) -> ModuleType:
    """Import ``durable/core/wheel`` as it was at ``rev``; return the package module."""
    name = f"wheel_at_{rev}"
    if name in sys.modules:
        return sys.modules[name]
    root = Path(tempfile.mkdtemp(prefix="durable-wheel-"))
    (root / name).mkdir()
    for file in FILES:
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:durable/core/wheel/{file}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (root / name / file).write_text(source.replace("durable.core.wheel", name))
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(root))
