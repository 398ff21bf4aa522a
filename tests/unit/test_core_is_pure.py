"""durable.core must import with Django unavailable (DESIGN §1: imports point downward)."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_imports_without_django():
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys

        class BlockDjango:
            def find_spec(self, name, path=None, target=None):
                if name == "django" or name.startswith("django."):
                    raise ImportError(f"django is blocked in this test: {name}")
                return None

        sys.meta_path.insert(0, BlockDjango())
        import durable.core
        names = [m.name for m in pkgutil.walk_packages(durable.core.__path__, "durable.core.")]
        for name in names:
            importlib.import_module(name)
        assert not any(m == "django" or m.startswith("django.") for m in sys.modules)
        print(len(names))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 1
