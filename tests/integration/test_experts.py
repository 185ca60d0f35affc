"""Experts follow their load on the real control plane (issue 33, item 5): an expert-parallel
role's two pods run the simulated inference server as processes of ``matrixpool sim`` with a
skewed gate; the operator reads their expert counters, re-plans the expert map (status.experts,
an Event ExpertsRebalanced), the scheduling cycle writes the ConfigMap in the new layout, the
process kubelet refreshes the mounted file and the servers' per-card load follows it, with no
pod restarted.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.placement import eplb
from matrixpool.serving import experts
from tests.integration import framework, manifests

pytestmark = pytest.mark.integration

COUNT, REDUNDANT = 4, 4  # one instance of 2 pods × 4 cards
SERVER = {
    "name": "server",
    "image": "matrixpool:test",
    "command": ["python", "-m", "matrixpool.serving", "--drain-seconds", "5",
                "--expert-skew", "1.5", "--expert-seed", "3", "--experts-per-token", "2"],
}  # fmt: skip


def service(name: str) -> dict[str, Any]:
    role = {
        "name": "moe",
        "replicas": 1,
        "podsPerReplica": 2,
        "cardsPerPod": 4,
        "expertParallel": {"experts": COUNT, "redundantExperts": REDUNDANT},
        "template": {"spec": {"terminationGracePeriodSeconds": 5, "containers": [SERVER]}},
    }
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"superNode": "sn-0", "roles": [role]},
    }


@pytest.fixture
def sim(cluster: framework.TestCluster, tmp_path: Path) -> Iterator[framework.Sim]:
    sn = manifests.supernode("sn-0").spares(0).yaml()
    with framework.sim_on(cluster, tmp_path / "sim", sn) as process:
        yield process


@pytest.fixture
def operator(
    cluster: framework.TestCluster, sim: framework.Sim, tmp_path: Path
) -> Iterator[framework.Operator]:
    env = {"MATRIXPOOL_EXPERTS_PERIOD_SECONDS": "3"}
    with framework.operator_beside(cluster, sim, tmp_path / "operator.log", env) as process:
        yield process


def serving_pods(cluster: framework.TestCluster, namespace: str) -> dict[str, dict[str, Any]]:
    """The service's pods that answer /healthz, by name."""
    found = {}
    for pod in framework.gang_pods(cluster, namespace):
        ip = (pod.get("status") or {}).get("podIP")
        if ip and _get(f"http://{ip}:8000/healthz") is not None:
            found[pod["metadata"]["name"]] = pod
    return found


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return str(answer.read().decode())
    except OSError:
        return None


def load(ips: list[str], requests: int) -> None:
    """``requests`` completions of 40 tokens to each pod."""
    body = json.dumps({"model": "m", "prompt": [1] * 39, "max_tokens": 1}).encode()
    for ip in ips:
        for _ in range(requests):
            request = urllib.request.Request(
                f"http://{ip}:8000/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                assert answer.status == 200


def slot_tokens(ips: list[str]) -> dict[int, float]:
    """Tokens per card of the map, the pods' counters summed."""
    total: dict[int, float] = {}
    for ip in ips:
        text = _get(f"http://{ip}:8000/metrics") or ""
        for line in text.splitlines():
            if line.startswith(experts.SLOT_TOKENS + "{"):
                slot = int(line.split('slot="')[1].split('"')[0])
                total[slot] = total.get(slot, 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def experts_status(cluster: framework.TestCluster, namespace: str) -> dict[str, Any] | None:
    body = json.loads(cluster.kubectl("get", "infer", "moe", "-n", namespace, "-o", "json").stdout)
    found = (body.get("status") or {}).get("experts") or []
    return found[0] if found and found[0].get("rebalancedTime") else None


def mapped_layout(cluster: framework.TestCluster, namespace: str) -> list[int]:
    out = cluster.kubectl("get", "cm", "moe-expert-map", "-n", namespace, "-o", "json").stdout
    entries = json.loads(json.loads(out)["data"]["moe-0.json"])
    return [e["copyOf"] for e in sorted(entries, key=lambda e: e["expert"])]


def test_a_skewed_load_rebalances_the_expert_map_and_the_pods_follow_it_without_restarting(
    cluster: framework.TestCluster, operator: framework.Operator, namespace: str
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(service("moe")))
    pods = framework.eventually(
        lambda: (found := serving_pods(cluster, namespace)) and len(found) == 2 and found,
        timeout=90,
        what="both pods serving",
    )
    uids = {name: pod["metadata"]["uid"] for name, pod in pods.items()}
    ips = [pod["status"]["podIP"] for pod in pods.values()]
    first = list(eplb.default_layout(COUNT, COUNT + REDUNDANT))
    framework.eventually(
        lambda: mapped_layout(cluster, namespace) == first, timeout=30, what="the first map"
    )
    # 1. the skewed load: the operator re-plans
    framework.eventually(
        lambda: load(ips, 10) or experts_status(cluster, namespace),
        timeout=60,
        interval=1.0,
        what="status.experts re-planned",
    )
    status = experts_status(cluster, namespace)
    assert status is not None
    print("status.experts:", json.dumps(status))
    assert status["imbalanceAfter"] <= 0.7 * status["imbalanceBefore"], status
    assert status["hottest"][0]["copies"] > 1
    # 2. the ConfigMap follows, then the pods' mounted file: their per-card load evens out
    framework.eventually(
        lambda: mapped_layout(cluster, namespace) == status["layout"],
        timeout=30,
        what="the map in the new layout",
    )

    def balanced() -> float | None:
        before = slot_tokens(ips)
        load(ips, 10)
        after = slot_tokens(ips)
        seen = eplb.imbalance([after[s] - before.get(s, 0.0) for s in after])
        print("per-card max/mean of the last requests:", round(seen, 3))
        return seen if seen <= 1.15 * status["imbalanceAfter"] else None

    framework.eventually(balanced, timeout=60, interval=1.0, what="per-card load evened out")
    # 3. the same pods, never restarted
    now = framework.gang_pods(cluster, namespace)
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in now} == uids
    for pod in now:
        assert all(c.get("restartCount", 0) == 0 for c in pod["status"]["containerStatuses"])
    events = cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    assert "ExpertsRebalanced" in events
