"""The kubectl plugin (``kubectl-matrixpool``) against the real control plane (issue 7): status,
the card map in the terminal and as a PNG whose pixels match the allocation, jobs, and an
empty recovery timeline."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.kubectl import render
from matrixpool.kubectl.report import Owner
from tests.integration import framework, manifests
from tests.unit.kubectl.test_render import colour_counts, decode_png

PLUGIN = Path(sys.executable).parent / "kubectl-matrixpool"
NODES_PER_SUPERNODE = 48
CARDS_PER_NODE = 8


def gang_pods(cluster: framework.TestCluster, namespace: str | None = None) -> list[dict[str, Any]]:
    scope = ["-n", namespace] if namespace else ["-A"]
    out = cluster.kubectl("get", "pods", *scope, "-l", "matrixpool.dev/job", "-o", "json").stdout
    return list(json.loads(out)["items"])


def get(cluster: framework.TestCluster, kind: str, name: str, *scope: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", kind, name, *scope, "-o", "json").stdout))


@pytest.fixture
def supernodes(cluster: framework.TestCluster) -> Iterator[list[str]]:
    """sn-0 and sn-1, one spare node each, over a cluster with no gang pods left."""
    framework.eventually(lambda: not gang_pods(cluster), timeout=60, what="no gang pods left")
    names = ["sn-0", "sn-1"][: cluster.shape.supernodes]
    for name in names:
        cluster.kubectl("apply", "-f", "-", input=manifests.supernode(name).yaml())
    yield names
    for name in names:
        cluster.kubectl("delete", "supernode", name, check=False)


def plugin(cluster: framework.TestCluster, *args: str) -> str:
    result = subprocess.run(
        [str(PLUGIN), *args], capture_output=True, text=True, env=cluster.env(), check=False
    )
    assert result.returncode == 0, f"kubectl-matrixpool {' '.join(args)}:\n{result.stderr}"
    print(f"$ kubectl matrixpool {' '.join(args)}\n{result.stdout}")  # shown on failure
    return result.stdout


def bound(cluster: framework.TestCluster, namespace: str) -> list[dict[str, Any]]:
    """The 4 training and 2 inference pods, once all are bound."""

    def probe() -> list[dict[str, Any]] | None:
        pods = gang_pods(cluster, namespace)
        return pods if len(pods) == 6 and all(p["spec"].get("nodeName") for p in pods) else None

    return framework.eventually(probe, timeout=60, what="6 gang pods bound")


def idle_node(cluster: framework.TestCluster) -> str:
    """A node of sn-0 that holds no pod and is not the spare."""
    busy = {p["spec"].get("nodeName") for p in gang_pods(cluster)}
    busy |= set(get(cluster, "supernode", "sn-0")["status"]["spareNodes"])
    nodes = (f"sn-0-node-{i:02d}" for i in range(NODES_PER_SUPERNODE))
    return next(n for n in nodes if n not in busy)


def settled_status(cluster: framework.TestCluster) -> dict[str, Any]:
    """sn-0's card counts once the operator has seen the gangs and the bad cards."""

    def probe() -> dict[str, Any] | None:
        cards = (get(cluster, "supernode", "sn-0").get("status") or {}).get("cards") or {}
        return cards if (cards.get("allocated"), cards.get("unhealthy")) == (48, 2) else None

    return framework.eventually(probe, timeout=30, what="sn-0 with 48 allocated, 2 unhealthy")


def test_plugin_shows_status_card_map_jobs_and_recoveries_of_a_busy_supernode(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    supernodes: list[str],
    tmp_path: Path,
) -> None:
    job = manifests.training_job("llm").replicas(4).cards(8).on("sn-0")
    service = manifests.inference_service("chat", "sn-0").role("serve", replicas=2, cards=8)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=service.yaml())
    bound(cluster, namespace)
    node = idle_node(cluster)
    cluster.matrixpool("cluster", "fault", "cards", node, "3,5")
    try:
        settled_status(cluster)
        check_status(cluster)
        check_cards(cluster, node, tmp_path / "sn-0.png")
        check_jobs_and_recoveries(cluster, namespace)
    finally:
        cluster.matrixpool("cluster", "fault", "cards", node, "")


def check_status(cluster: framework.TestCluster) -> None:
    lines = plugin(cluster, "status").splitlines()
    header = lines[0].split()
    rows = {line.split()[0]: dict(zip(header, line.split(), strict=False)) for line in lines[1:]}
    assert set(rows) == {"sn-0", "sn-1"}
    sn0 = rows["sn-0"]
    counts = {k: int(sn0[k]) for k in ("TRAINING", "INFERENCE", "SPARE", "UNHEALTHY", "FREE")}
    total = NODES_PER_SUPERNODE * CARDS_PER_NODE
    assert counts == {
        "TRAINING": 32,
        "INFERENCE": 16,
        "SPARE": 8,
        "UNHEALTHY": 2,
        "FREE": total - 32 - 16 - 8 - 2,
    }
    assert sn0["NODES"] == "48/48"
    assert (rows["sn-1"]["TRAINING"], rows["sn-1"]["INFERENCE"]) == ("0", "0")


def check_cards(cluster: framework.TestCluster, bad_node: str, png: Path) -> None:
    text = plugin(cluster, "cards", "sn-0", "--png", str(png))
    assert "\x1b[" not in text  # stdout is a pipe: no colours
    node_line = next(line for line in text.splitlines() if line.strip().startswith(bad_node))
    assert node_line.split()[1:] == [".", ".", ".", "X", ".", "X", ".", "."]
    expected = {
        Owner.TRAINING: 32,
        Owner.INFERENCE: 16,
        Owner.SPARE: 8,
        Owner.UNHEALTHY: 2,
        Owner.DOWN: 0,
    }
    expected[Owner.FREE] = NODES_PER_SUPERNODE * CARDS_PER_NODE - sum(expected.values())
    assert f"wrote {png}: " + ", ".join(f"{o.value} {expected[o]}" for o in Owner) in text
    _, _, rows = decode_png(png.read_bytes())
    pixels = colour_counts(rows)
    area = render.BLOCK * render.BLOCK
    assert {o: pixels[render.RGB[o]] for o in Owner} == {o: n * area for o, n in expected.items()}


def check_jobs_and_recoveries(cluster: framework.TestCluster, namespace: str) -> None:
    lines = plugin(cluster, "jobs", "-n", namespace).splitlines()
    rows = {tuple(line.split()[1:3]): line.split() for line in lines[1:]}
    assert set(rows) == {("TrainingJob", "llm"), ("InferenceService", "chat")}
    assert rows[("TrainingJob", "llm")][4:8] == ["sn-0", "32", "4", "4"]  # desired, bound
    assert rows[("InferenceService", "chat")][4:6] == ["sn-0", "16"]
    everywhere = plugin(cluster, "jobs", "-A")
    assert namespace in everywhere
    assert plugin(cluster, "recoveries", "llm", "-n", namespace).strip() == "llm: no recoveries"
    same = cluster.matrixpool("recoveries", "llm", "-n", namespace).stdout  # the delegation
    assert same.strip() == "llm: no recoveries"
