"""The local control plane itself: a real API server, the CRDs Established, kwok nodes Ready,
and fault injection through the `matrixpool cluster` commands."""

from __future__ import annotations

import json

from tests.integration import framework

CRDS = ("supernodes", "trainingjobs", "inferenceservices")


def test_kubectl_version_shows_the_real_server(cluster: framework.TestCluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.")
    assert version["serverVersion"]["major"] == "1"


def test_the_three_crds_are_established(cluster: framework.TestCluster) -> None:
    for plural in CRDS:
        crd = json.loads(
            cluster.kubectl("get", "crd", f"{plural}.matrixpool.dev", "-o", "json").stdout
        )
        established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert established.get("Established") == "True", plural


def test_every_simulated_node_is_ready_with_cards_and_labels(
    cluster: framework.TestCluster,
) -> None:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert len(nodes) == cluster.shape.node_count
    for node in nodes:
        labels = node["metadata"]["labels"]
        index = int(node["metadata"]["name"].rsplit("-", 1)[1])
        supernode = labels["matrixpool.dev/supernode"]
        assert labels["matrixpool.dev/rack"] == f"{supernode}-rack-{index // 4}"
        assert node["status"]["allocatable"]["huawei.com/Ascend910"] == "8"
        assert node["status"]["capacity"]["huawei.com/Ascend910"] == "8"
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready[0]["status"] == "True", node["metadata"]["name"]


def test_cluster_commands_report_status_and_kubeconfig(cluster: framework.TestCluster) -> None:
    status = json.loads(cluster.matrixpool("cluster", "status").stdout)
    assert status["ready"] is True
    assert all(p["alive"] for p in status["processes"].values())
    assert cluster.matrixpool("cluster", "kubeconfig").stdout.strip() == str(cluster.kubeconfig)


def test_node_down_and_up_flip_ready_through_kwok(cluster: framework.TestCluster) -> None:
    node = "sn-0-node-05"

    def ready() -> str:
        body = json.loads(cluster.kubectl("get", "node", node, "-o", "json").stdout)
        return next(c["status"] for c in body["status"]["conditions"] if c["type"] == "Ready")

    cluster.matrixpool("cluster", "fault", "node-down", node)
    framework.eventually(lambda: ready() == "False", timeout=20, what=f"{node} NotReady")
    cluster.matrixpool("cluster", "fault", "node-up", node)
    framework.eventually(lambda: ready() == "True", timeout=20, what=f"{node} Ready again")


def test_card_fault_sets_and_clears_the_annotation(cluster: framework.TestCluster) -> None:
    node = "sn-0-node-06"
    key = "matrixpool.dev/unhealthy-cards"

    def annotation() -> str | None:
        body = json.loads(cluster.kubectl("get", "node", node, "-o", "json").stdout)
        return body["metadata"].get("annotations", {}).get(key)

    cluster.matrixpool("cluster", "fault", "cards", node, "3,5")
    assert annotation() == "3,5"
    cluster.matrixpool("cluster", "fault", "cards", node, "")
    assert annotation() is None
    bad = cluster.matrixpool("cluster", "fault", "cards", node, "three", check=False)
    assert bad.returncode == 1
    assert "card list" in bad.stderr
