"""The Grafana dashboard of the chart (charts/matrixpool/dashboards/matrixpool.json).

The JSON loads; every query names only metrics that matrixpool exports (read from the
prometheus-client registry after importing the operator's and the daemon's metrics modules);
the chart ships it as a ConfigMap for Grafana's sidecar when ``dashboard.enabled`` is set. The
helm binary comes from tools/k8s/build.sh, wrapped by test_chart.py's Helm.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from matrixpool import metrics as operator_metrics
from matrixpool_recovery import metrics as daemon_metrics
from tests.unit.chart import test_chart as chart

DASHBOARD = chart.CHART / "dashboards" / "matrixpool.json"
ENABLED = "dashboard.enabled=true"
# Series each family type exposes, after its family name (prometheus-client drops _total).
SERIES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}
# Words of PromQL that are neither functions nor metrics.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
MATCHERS = re.compile(r"\{[^}]*\}|\[[^\]]*\]")  # label matchers, ranges and subqueries
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
VARIABLE = re.compile(r"\$\{?\w+\}?")
IDENTIFIER = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions or labels."""
    for pattern in (STRING, MATCHERS, GROUPING, VARIABLE):
        expr = pattern.sub(" ", expr)
    found = set()
    for match in IDENTIFIER.finditer(expr):
        name, call = match.groups()
        if not call and name.lower() not in KEYWORDS:
            found.add(name)
    return found


def exported() -> set[str]:
    """Every series name the operator and the daemon export."""
    assert operator_metrics.SUPERNODE_CARDS  # imported: registered
    assert daemon_metrics.BYTES
    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("matrixpool_"):
            names |= {family.name + suffix for suffix in SERIES.get(family.type, ("",))}
    return names


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and the query variables."""
    for panel in panels():
        for target in panel["targets"]:
            yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
            assert found, variable["definition"]
            yield f"variable {variable['name']}", found[1]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ('matrixpool_pending_gangs{supernode=~"$supernode"}', {"matrixpool_pending_gangs"}),
        (
            "histogram_quantile(0.99, sum by (le, tier) (rate(x_bucket[$__rate_interval])))",
            {"x_bucket"},
        ),
        ('sum(rate(a_total{action="evict"}[5m])) by (action) > bool 0', {"a_total"}),
        ("a_bytes / on (instance) group_left b_bytes", {"a_bytes", "b_bytes"}),
        ("a unless b offset 5m or c_total", {"a", "b", "c_total"}),
        ("sum without (pod) (up) * 1e3 + vector(1)", {"up"}),
        ('label_replace(m, "dst", "$1", "src", "(.*)")', {"m"}),
    ],
    ids=[
        "a selector with a variable",
        "a quantile over a grouped rate",
        "grouping after the aggregation and a bool comparison",
        "vector matching",
        "set operators and an offset",
        "numbers and a function without a metric",
        "string arguments",
    ],
)
def test_the_extractor_finds_only_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_the_dashboard_is_grafana_json_with_a_supernode_variable() -> None:
    loaded = dashboard()

    assert loaded["uid"] == "matrixpool"
    variables = {v["name"]: v for v in loaded["templating"]["list"]}
    assert {"datasource", "supernode"} <= set(variables)
    assert variables["supernode"]["multi"]
    assert variables["supernode"]["includeAll"]
    assert len({p["id"] for p in loaded["panels"]}) == len(loaded["panels"])
    assert all(p["targets"] for p in panels())


def test_every_query_names_only_exported_metrics() -> None:
    known = exported()
    for where, expr in queries():
        names = metric_names(expr)
        assert names, f"{where} names no metric: {expr}"
        assert names <= known, f"{where} names unknown {names - known}: {expr}"


@pytest.mark.parametrize(
    "metric",
    [
        "matrixpool_supernode_cards",
        "matrixpool_pending_gangs",
        "matrixpool_gang_bind_seconds_bucket",
        "matrixpool_cycle_seconds_bucket",
        "matrixpool_preemptions_total",
        "matrixpool_ckpt_bytes_total",
        "matrixpool_ckpt_duration_seconds_bucket",
        "matrixpool_recoveries_total",
        "matrixpool_recovery_duration_seconds_bucket",
        "matrixpool_faults_detected_total",
        "matrixpool_recovery_failures_total",
        "matrixpool_timeshare_transitions_total",
        "matrixpool_timeshare_transition_seconds_bucket",
        "matrixpool_timeshare_checkpoint_requests_total",
    ],
)
def test_the_dashboard_shows(metric: str) -> None:
    assert any(metric in metric_names(expr) for _, expr in queries())


@pytest.mark.parametrize(
    ("title", "metric", "grouping"),
    [
        ("Recoveries by level", "matrixpool_recoveries_total", "level"),
        ("Recovery duration by level", "matrixpool_recovery_duration_seconds_bucket", "level"),
        ("Window transitions", "matrixpool_timeshare_transitions_total", "window"),
        ("Transition duration by phase", "matrixpool_timeshare_transition_seconds_bucket", "phase"),
    ],
)
def test_recoveries_and_transitions_have_panels_split_by(
    title: str, metric: str, grouping: str
) -> None:
    panel = next(p for p in panels() if p["title"] == title)
    for target in panel["targets"]:
        assert metric in metric_names(target["expr"])
        assert re.search(rf"by \([^)]*\b{grouping}\b", target["expr"]), target["expr"]
        assert "{{" + grouping + "}}" in target["legendFormat"]


def test_every_panel_sits_inside_the_24_column_grid_without_overlap() -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, panel["title"]
        taken |= cells


def test_the_supernode_panels_follow_the_variable() -> None:
    for where, expr in queries():
        if "matrixpool_supernode_" in expr and where.startswith("panel"):
            assert 'supernode=~"$supernode"' in expr, where


def test_the_chart_ships_no_dashboard_by_default(helm: chart.Helm) -> None:
    assert "ConfigMap" not in chart.kinds(helm.render())


def test_the_chart_ships_the_dashboard_for_grafanas_sidecar(helm: chart.Helm) -> None:
    config_map = chart.only(helm.render(ENABLED), "ConfigMap")

    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == chart.NAMESPACE
    assert json.loads(config_map["data"]["matrixpool.json"]) == dashboard()


def test_the_dashboard_value_must_be_a_boolean(helm: chart.Helm) -> None:
    result = helm.template("dashboard.enabled=yes-please")

    assert result.returncode != 0
    assert "dashboard" in result.stderr
