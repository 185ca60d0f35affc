"""Placement respects the pod, on the real control plane (issue 13): CPU and memory requested
by the template against the node's allocatable less every pod already there, taints and
tolerations, nodeSelector and cordon — and a gang kept out by one of these says which in its
``Scheduled`` condition and a Warning Event.

Each test gets a pool of its own: a SuperNode over 4 nodes (one rack, no spare) labelled for
the test, whose taints, labels and cordon are put back afterwards. The kwok nodes have 192 cpu
and 1536Gi of memory allocatable (:mod:`matrixpool.devcluster.topology`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from matrixpool.devcluster import topology
from tests.integration import framework, manifests

POOL_LABEL = "matrixpool.dev/test-pool"
CARDS = "huawei.com/Ascend910"


@dataclass
class Pool:
    name: str  # the SuperNode's
    nodes: list[str]  # its 4 nodes, in name order
    namespace: str
    cluster: framework.TestCluster

    def kubectl(self, *args: str, input: str | None = None) -> str:
        return self.cluster.kubectl(*args, input=input).stdout

    def job(self, name: str, replicas: int, **pod_spec: Any) -> None:
        """A TrainingJob of ``replicas`` × 8 cards on the pool; ``pod_spec`` goes into its
        template's spec (``resources`` into its container's, ``container`` merged into it)."""
        body = manifests.training_job(name).replicas(replicas).cards(8).on(self.name).body
        spec = body["spec"]["template"]["spec"]
        resources = pod_spec.pop("resources", None)
        if resources:
            spec["containers"][0]["resources"] = resources
        spec["containers"][0].update(pod_spec.pop("container", {}))
        spec.update(pod_spec)
        self.kubectl("apply", "-n", self.namespace, "-f", "-", input=json.dumps(body))

    def delete_job(self, name: str) -> None:
        self.kubectl("delete", "trainingjob", name, "-n", self.namespace, "--wait=true")
        framework.eventually(
            lambda: not self.pods_of(name), timeout=60, what=f"the pods of {name} gone"
        )

    def pods_of(self, job: str) -> list[dict[str, Any]]:
        out = self.kubectl(
            "get", "pods", "-n", self.namespace, "-l", f"matrixpool.dev/job={job}", "-o", "json"
        )
        return list(json.loads(out)["items"])

    def bound_nodes(self, job: str, replicas: int, timeout: float = 60) -> list[str]:
        def probe() -> list[str] | None:
            nodes = [p["spec"].get("nodeName") for p in self.pods_of(job)]
            return sorted(nodes) if len(nodes) == replicas and all(nodes) else None

        return framework.eventually(probe, timeout=timeout, what=f"{job} bound whole")

    def waiting(self, job: str, reason: str, timeout: float = 60) -> str:
        """The Scheduled=False message of ``job`` once it gives ``reason``; no pod bound."""

        def probe() -> str | None:
            out = self.kubectl("get", "trainingjob", job, "-n", self.namespace, "-o", "json")
            conditions = (json.loads(out).get("status") or {}).get("conditions") or []
            scheduled: dict[str, Any] = next(
                (c for c in conditions if c["type"] == "Scheduled"), {}
            )
            if scheduled.get("status") == "False" and scheduled.get("reason") == reason:
                return str(scheduled["message"])
            return None

        message = framework.eventually(probe, timeout=timeout, what=f"{job} waiting: {reason}")
        assert not any(p["spec"].get("nodeName") for p in self.pods_of(job)), "no pod bound"
        return message

    def warned(self, job: str, reason: str) -> str:
        """The message of the Warning Event ``reason`` on ``job``."""

        def probe() -> str | None:
            out = self.kubectl(
                "get",
                "events",
                "-n",
                self.namespace,
                "--field-selector",
                f"involvedObject.name={job},type=Warning,reason={reason}",
                "-o",
                "json",
            )
            items = json.loads(out)["items"]
            return str(items[0]["message"]) if items else None

        return framework.eventually(probe, timeout=30, what=f"a {reason} Event on {job}")

    def foreign_pod(self, name: str, node: str, **requests: str) -> None:
        """A pod matrixpool does not place, bound to ``node``, requesting ``requests``."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeName": node,
                "containers": [
                    {**manifests.CONTAINER, "resources": {"requests": requests, "limits": requests}}
                ],
            },
        }
        self.kubectl("apply", "-n", self.namespace, "-f", "-", input=json.dumps(body))

    def delete_pod(self, name: str) -> None:
        self.kubectl("delete", "pod", name, "-n", self.namespace, "--grace-period=0", "--force")


@pytest.fixture
def pool(
    cluster: framework.TestCluster, operator: framework.Operator, namespace: str
) -> Iterator[Pool]:
    """A SuperNode of the last 4 nodes of the last supernode, taints, labels and cordon put
    back afterwards."""
    framework.eventually(
        lambda: not framework.gang_pods(cluster), timeout=60, what="no gang pods left"
    )
    last = cluster.shape.supernodes - 1
    count = cluster.shape.nodes_per_supernode
    nodes = [topology.node_name(last, k) for k in range(count - 4, count)]
    name = framework.unique("pool")
    for node in nodes:
        cluster.kubectl("label", "node", node, f"{POOL_LABEL}={name}", "--overwrite")
    supernode = manifests.supernode(name, spares=0).body
    supernode["spec"]["nodeSelector"] = {"matchLabels": {POOL_LABEL: name}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(supernode))
    try:
        yield Pool(name, nodes, namespace, cluster)
    finally:
        cluster.kubectl("delete", "supernode", name, check=False)
        for node in nodes:
            cluster.kubectl("uncordon", node, check=False)
            cluster.kubectl("taint", "node", node, "dedicated-", check=False)
            cluster.kubectl("label", "node", node, f"{POOL_LABEL}-", check=False)
            cluster.kubectl("label", "node", node, "zone-", check=False)


def test_a_gang_short_of_cpu_where_other_pods_run_waits_naming_cpu(pool: Pool) -> None:
    for k, node in enumerate(pool.nodes[:3]):
        pool.foreign_pod(f"busy-{k}", node, cpu="100")  # 92 of 192 cpu left there
    pool.job("hungry", 2, resources={"requests": {"cpu": "100"}})
    message = pool.waiting("hungry", "InsufficientResources")
    assert "3 node(s) with insufficient cpu" in message, message
    assert "insufficient cpu" in pool.warned("hungry", "InsufficientResources")
    pool.delete_pod("busy-0")
    assert pool.bound_nodes("hungry", 2) == [pool.nodes[0], pool.nodes[3]]


def test_a_gang_short_of_memory_waits_naming_memory(pool: Pool) -> None:
    for k, node in enumerate(pool.nodes):
        pool.foreign_pod(f"big-{k}", node, memory="1000Gi")  # 536Gi left on each
    pool.job("greedy", 1, resources={"requests": {"memory": "600Gi"}})
    message = pool.waiting("greedy", "InsufficientResources")
    assert "4 node(s) with insufficient memory" in message, message
    pool.job("modest", 1, resources={"requests": {"memory": "500Gi"}})
    assert len(pool.bound_nodes("modest", 1)) == 1


def test_a_tainted_node_is_avoided_unless_tolerated(pool: Pool) -> None:
    for node in pool.nodes[:3]:
        pool.kubectl("taint", "node", node, "dedicated=infer:NoSchedule")
    pool.job("plain", 1)
    assert pool.bound_nodes("plain", 1) == [pool.nodes[3]]
    pool.job("shut-out", 1)
    message = pool.waiting("shut-out", "UntoleratedTaint")
    assert "3 node(s) had untolerated taint dedicated=infer:NoSchedule" in message, message
    toleration = {"key": "dedicated", "operator": "Equal", "value": "infer"}
    pool.job("tolerant", 3, tolerations=[{**toleration, "effect": "NoSchedule"}])
    assert pool.bound_nodes("tolerant", 3) == pool.nodes[:3]


def test_a_node_selector_restricts_the_nodes(pool: Pool) -> None:
    pool.kubectl("label", "node", pool.nodes[2], "zone=z1")
    pool.job("picky", 1, nodeSelector={"zone": "z1"})
    assert pool.bound_nodes("picky", 1) == [pool.nodes[2]]
    pool.job("pickier", 1, nodeSelector={"zone": "z1"})
    message = pool.waiting("pickier", "NodeSelectorMismatch")
    assert "3 node(s) didn't match nodeSelector" in message, message


def test_a_cordoned_node_gets_no_new_gang(pool: Pool) -> None:
    pool.kubectl("cordon", pool.nodes[1])
    pool.job("three", 3)
    assert pool.nodes[1] not in pool.bound_nodes("three", 3)
    pool.delete_job("three")
    pool.job("four", 4)
    message = pool.waiting("four", "NodesCordoned")
    assert "3/4 nodes can take a pod: 1 node(s) cordoned" in message, message
    pool.kubectl("uncordon", pool.nodes[1])
    assert pool.bound_nodes("four", 4) == pool.nodes


def test_a_baseline_namespace_runs_our_pods_and_refuses_a_privileged_or_host_path_template(
    pool: Pool,
) -> None:
    """Issue 31, finding 1: the namespace's Pod Security admission judges the operator's pods
    like any other: ours pass ``baseline`` (no hostPath: the trainer saves over HTTP), a
    template asking for a privileged container or a hostPath is refused, and the gang says so."""
    pool.kubectl(
        "label", "namespace", pool.namespace, "pod-security.kubernetes.io/enforce=baseline"
    )
    pool.job("plain", 1)
    pool.bound_nodes("plain", 1)
    [pod] = pool.pods_of("plain")
    assert [v["name"] for v in pod["spec"]["volumes"] if "hostPath" in v] == []
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert "MATRIXPOOL_CKPT_DAEMON" in env
    assert "MATRIXPOOL_CKPT_SOCKET" not in env

    privileged = {"securityContext": {"privileged": True}}
    pool.job("root", 1, container=privileged)
    message = pool.waiting("root", "PodSecurity")
    assert 'violates PodSecurity "baseline' in message, message
    assert "privileged" in message, message
    assert "Pod Security admission" in pool.warned("root", "PodSecurity")
    pool.job("host", 1, volumes=[{"name": "all", "hostPath": {"path": "/"}}])
    assert "hostPath" in pool.waiting("host", "PodSecurity")
    assert pool.pods_of("root") == pool.pods_of("host") == []
