"""The SuperNode handler on the real control plane: it pools the cards of 48 kwok nodes, follows
card and node faults within seconds, flags overlapping selectors, and an operator killed with
SIGKILL comes back to the same status."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from prometheus_client import parser

from tests.integration import framework

SN = "sn-0"


def supernode(name: str, selector_value: str, spares: int = 1) -> str:
    return json.dumps(
        {
            "apiVersion": "matrixpool.dev/v1alpha1",
            "kind": "SuperNode",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": selector_value}},
                "cardResource": "huawei.com/Ascend910",
                "cardsPerNode": 8,
                "topologyKeys": ["matrixpool.dev/rack"],
                "spares": {"nodes": spares},
            },
        }
    )


def status_of(cluster: framework.TestCluster, name: str) -> dict[str, Any]:
    body = json.loads(cluster.kubectl("get", "supernode", name, "-o", "json").stdout)
    return dict(body.get("status") or {})


def ready_condition(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})


@pytest.fixture
def sn0(cluster: framework.TestCluster) -> Any:
    cluster.kubectl("apply", "-f", "-", input=supernode(SN, SN))
    yield SN
    cluster.kubectl("delete", "supernode", SN, "--wait=true", check=False)


def wait_for_cards(
    cluster: framework.TestCluster, expected: dict[str, int], nodes_ready: int, timeout: float = 15
) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        status = status_of(cluster, SN)
        cards = status.get("cards") or {}
        shown = {key: cards.get(key) for key in expected}  # inference/training/free: elsewhere
        ok = shown == expected and status.get("nodes", {}).get("ready") == nodes_ready
        return status if ok else None

    return framework.eventually(probe, timeout=timeout, what=f"{SN} cards {expected}")


HEALTHY = {"total": 384, "allocatable": 376, "allocated": 0, "unhealthy": 0, "spare": 8}


def test_supernode_of_48_nodes_reports_384_cards(
    cluster: framework.TestCluster, operator: framework.Operator, sn0: str
) -> None:
    status = wait_for_cards(cluster, HEALTHY, nodes_ready=48, timeout=30)
    assert status["nodes"] == {"total": 48, "ready": 48}
    assert ready_condition(status)["status"] == "True"
    assert ready_condition(status)["reason"] == "NodesReady"
    row = cluster.kubectl("get", "supernode", SN, "--no-headers").stdout.split()
    assert "384" in row, row


def test_card_and_node_faults_show_in_status_within_seconds(
    cluster: framework.TestCluster, operator: framework.Operator, sn0: str
) -> None:
    wait_for_cards(cluster, HEALTHY, nodes_ready=48, timeout=30)
    try:
        cluster.matrixpool("cluster", "fault", "cards", "sn-0-node-10", "3,5")
        cluster.matrixpool("cluster", "fault", "node-down", "sn-0-node-20")
        wait_for_cards(
            cluster,
            {"total": 384, "allocatable": 366, "allocated": 0, "unhealthy": 10, "spare": 8},
            nodes_ready=47,
            timeout=10,
        )
    finally:
        cluster.matrixpool("cluster", "fault", "cards", "sn-0-node-10", "")
        cluster.matrixpool("cluster", "fault", "node-up", "sn-0-node-20")
    wait_for_cards(cluster, HEALTHY, nodes_ready=48, timeout=20)


def test_overlapping_selector_gets_a_condition_and_an_event(
    cluster: framework.TestCluster, operator: framework.Operator, sn0: str
) -> None:
    cluster.kubectl("apply", "-f", "-", input=supernode("sn-0-copy", SN, spares=0))
    try:

        def overlapping() -> dict[str, Any] | None:
            condition = ready_condition(status_of(cluster, "sn-0-copy"))
            return condition if condition.get("reason") == "SelectorOverlap" else None

        condition = framework.eventually(overlapping, timeout=15, what="SelectorOverlap")
        assert condition["status"] == "False"
        assert "spec.nodeSelector" in condition["message"]
        events = framework.eventually(
            lambda: cluster.kubectl(
                "get",
                "events",
                "-A",
                "--field-selector",
                "involvedObject.name=sn-0-copy,reason=SelectorOverlap",
                "-o",
                "name",
            ).stdout.strip(),
            timeout=15,
            what="SelectorOverlap event",
        )
        assert events
        assert operator.process is not None
        assert operator.process.poll() is None
    finally:
        cluster.kubectl("delete", "supernode", "sn-0-copy", check=False)


def test_operator_killed_with_sigkill_converges_to_the_same_status(
    cluster: framework.TestCluster, operator: framework.Operator, sn0: str
) -> None:
    before = wait_for_cards(cluster, HEALTHY, nodes_ready=48, timeout=30)
    operator.kill()
    # While the operator is dead the world changes; the restarted one must notice.
    cluster.matrixpool("cluster", "fault", "cards", "sn-0-node-11", "0")
    try:
        operator.start()
        wait_for_cards(
            cluster, {**HEALTHY, "allocatable": 375, "unhealthy": 1}, nodes_ready=48, timeout=30
        )
    finally:
        cluster.matrixpool("cluster", "fault", "cards", "sn-0-node-11", "")
    after = wait_for_cards(cluster, HEALTHY, nodes_ready=48, timeout=20)
    assert after["nodes"] == before["nodes"]
    assert ready_condition(after)["status"] == ready_condition(before)["status"]
    operator.kill()
    operator.start()
    again = wait_for_cards(cluster, HEALTHY, nodes_ready=48, timeout=30)
    assert again["cards"] == before["cards"]


def test_metrics_endpoint_is_scraped_and_parsed_with_prometheus_conventions(
    cluster: framework.TestCluster, operator: framework.Operator, sn0: str
) -> None:
    wait_for_cards(cluster, HEALTHY, nodes_ready=48, timeout=30)
    url = f"http://127.0.0.1:{operator.metrics_port}/metrics"

    def samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return None
        found = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text)
            for s in family.samples
        }
        key = ("matrixpool_supernode_cards", (("state", "total"), ("supernode", SN)))
        return found if found.get(key) == 384 else None

    found = framework.eventually(samples, timeout=20, what="metrics with sn-0's 384 cards")
    ours = {name for name, _ in found if name.startswith("matrixpool_")}
    assert {
        "matrixpool_supernode_cards",
        "matrixpool_pending_gangs",
        "matrixpool_bound_pods_total",
        "matrixpool_cycle_seconds_count",
    } <= ours
    assert found[("matrixpool_supernode_cards", (("state", "spare"), ("supernode", SN)))] == 8
    assert found[("matrixpool_supernode_nodes", (("state", "ready"), ("supernode", SN)))] == 48
    for name in ours:  # base units and suffixes as Prometheus asks
        assert name == name.lower()
        assert not name.endswith("_ms")
