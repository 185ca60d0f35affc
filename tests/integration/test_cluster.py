"""The local control plane itself: a real API server, the CRDs Established, kwok nodes Ready,
and fault injection through the `matrixpool cluster` commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_cluster_up_and_down_are_idempotent_and_leave_no_process(
    cluster: framework.TestCluster, tmp_path: Path
) -> None:
    """A second small cluster, driven only through the CLI as a user would."""
    env = {**os.environ, "MATRIXPOOL_CLUSTER_DIR": str(tmp_path / "own")}

    def matrixpool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "matrixpool.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )

    up = ("cluster", "up", "--nodes-per-supernode", "4", "--nodes-per-rack", "2")
    first = matrixpool(*up)
    kubeconfig = tmp_path / "own" / "kubeconfig"
    assert first.stdout.strip().splitlines()[-1] == f"export KUBECONFIG={kubeconfig}"
    again = matrixpool(*up)
    assert "already running" in again.stderr
    pids = [
        p["pid"] for p in json.loads(matrixpool("cluster", "status").stdout)["processes"].values()
    ]
    assert len(pids) == 7  # etcd, kube-apiserver, -controller-manager, -scheduler, kwok, DNS x2
    matrixpool("cluster", "down")
    matrixpool("cluster", "down")
    for pid in pids:
        framework.eventually(lambda pid=pid: not _alive(pid), timeout=15, what=f"pid {pid} gone")
    status = subprocess.run(
        [sys.executable, "-m", "matrixpool.cli", "cluster", "status"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert status.returncode == 1
    assert json.loads(status.stdout)["ready"] is False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[-1].split()[0] != "Z"
