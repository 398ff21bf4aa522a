"""durable's pytest plugin is registered by the distribution and costs nothing to load.

pytest loads every ``pytest11`` entry point of every installed distribution, in every
project: the plugin must import neither Django nor the engine until a test asks for its
fixture (``tests/integration/test_time_machine.py`` uses the fixture through this entry
point; no conftest defines it).
"""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points


def test_the_distribution_registers_the_plugin():
    found = {ep.name: ep.value for ep in entry_points(group="pytest11")}
    assert found.get("durable") == "durable.testing.pytest_plugin"


def test_loading_the_plugin_imports_no_django():
    code = (
        "import sys, durable.testing.pytest_plugin as p; "
        "assert callable(p.durable_time_machine); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'django' "
        "or m.startswith('durable.worker')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
