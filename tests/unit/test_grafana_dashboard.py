"""``docs/grafana-dashboard.json`` queries only metrics the worker exports, and all of them.

The names a PromQL expression may use are derived from ``durable.metrics.WorkerMetrics``'s
own registry, the way Prometheus exposes them: a counter as ``<name>_total``, a
histogram as ``_bucket``/``_sum``/``_count``, a gauge as its name. Renaming a metric
without updating the dashboard fails here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from durable.metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names() -> dict[str, str]:
    """Sample name -> metric family name, for every metric of the worker."""
    names = {}
    for family in WorkerMetrics().registry.collect():
        for suffix in SUFFIXES[family.type]:
            names[family.name + suffix] = family.name
    return names


def expressions(node: object) -> list[str]:
    """Every ``expr`` of the dashboard's targets, at any depth (rows may nest panels)."""
    found: list[str] = []
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            found.append(node["expr"])
        for value in node.values():
            found += expressions(value)
    elif isinstance(node, list):
        for value in node:
            found += expressions(value)
    return found


def test_every_expression_uses_exported_metrics_and_every_metric_is_shown():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard["panels"])
    assert len(exprs) >= 11
    known = exported_names()
    used = set()
    for expr in exprs:
        metrics = re.findall(r"\bdurable_[a-z_]+", expr)
        assert metrics, f"no durable metric in {expr!r}"
        for name in metrics:
            assert name in known, f"{expr!r} uses {name}, which durable/metrics.py does not export"
            used.add(known[name])
    assert used == set(known.values()), f"not on the dashboard: {set(known.values()) - used}"


def test_the_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard["__inputs"][0]["pluginId"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
