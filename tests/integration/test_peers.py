"""The peers of benchmarks/peers.py run for real on the local control plane (``cluster up
--peers``): kube-scheduler's own gang scheduling with a topology constraint (PodGroup,
scheduling.k8s.io/v1beta1) and Kueue's Topology Aware Scheduling, each given a gang exactly as
the benchmark gives it; and Kueue scheduling by what ``matrixpool export topology`` wrote. A
cluster of its own: 1 supernode of 48 kwok nodes, racks of 4."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import peers
from matrixpool.api import labels
from matrixpool.devcluster import binaries, cluster, kueue, topology
from matrixpool.k8s import client as k8s_client
from tests.integration import framework, manifests

SHAPE = topology.Shape(supernodes=1)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster.Cluster]:
    local = cluster.Cluster(Path(tmp_path_factory.mktemp("peers")), tied=True)
    try:
        local.up(SHAPE, peers=True)
        yield local
    finally:
        local.down()


@pytest.fixture(scope="module")
def api(local: cluster.Cluster) -> k8s_client.Api:
    client = k8s_client.from_kubeconfig(local.kubeconfig)
    peers.prepare(client, SHAPE)
    return client


def pods_of(api: k8s_client.Api, gang: str) -> list[Any]:
    selector = f"{peers.GANG_LABEL}={gang}"
    return list(api.core.list_namespaced_pod(peers.NAMESPACE, label_selector=selector).items)


def racks_when_bound(api: k8s_client.Api, gang: str, count: int) -> set[str]:
    framework.eventually(
        lambda: sum(1 for p in pods_of(api, gang) if p.spec.node_name) == count,
        timeout=60,
        what=f"every pod of {gang} bound",
    )
    return {peers.NODE_RACKS[p.spec.node_name] for p in pods_of(api, gang)}


def test_kube_scheduler_binds_a_podgroup_gang_whole_inside_one_rack(api: k8s_client.Api) -> None:
    system = peers.KubeScheduler(api, SHAPE)
    try:
        system.submit(peers.Gang("ks-rack", 0.0, pods=4, cards=8, duration=0.0))
        assert len(racks_when_bound(api, "ks-rack", 4)) == 1
    finally:
        system.remove(peers.Gang("ks-rack", 0.0, 4, 8, 0.0))
        system.teardown()


def test_kube_scheduler_leaves_a_gang_that_fits_no_rack_wholly_unbound(
    api: k8s_client.Api,
) -> None:
    """5 whole-node pods required in one rack of 4 nodes: not one pod binds (all or nothing),
    and the PodGroup says why."""
    system = peers.KubeScheduler(api, SHAPE)
    five = peers.Gang("ks-five", 0.0, pods=5, cards=8, duration=0.0, within=labels.RACK)
    try:
        system.submit(five)
        group = framework.eventually(
            lambda: _scheduled_condition(api, "ks-five"), timeout=60, what="a PodGroup condition"
        )
        assert group["status"] == "False", group
        assert not [p for p in pods_of(api, "ks-five") if p.spec.node_name]
    finally:
        system.remove(five)
        system.teardown()


def test_kueue_admits_a_job_gang_into_one_rack_and_kube_scheduler_binds_it(
    api: k8s_client.Api,
) -> None:
    system = peers.Kueue(api, SHAPE)
    system.setup()
    gang = peers.Gang("kq-rack", 0.0, pods=4, cards=8, duration=0.0)
    try:
        system.submit(gang)
        assert len(racks_when_bound(api, "kq-rack", 4)) == 1
        for pod in pods_of(api, "kq-rack"):
            assert not pod.spec.scheduling_gates, "Kueue ungated the pod"
            assert pod.spec.node_selector.get("kubernetes.io/hostname") == pod.spec.node_name
    finally:
        system.remove(gang)


def test_exported_kueue_topology_is_accepted_and_kueue_places_a_rack_job_by_it(
    local: cluster.Cluster, api: k8s_client.Api
) -> None:
    """``matrixpool export topology --format kueue`` for SuperNode sn-0, applied with kubectl
    (Kueue's CRDs and webhooks judge it); then a ClusterQueue of the exported flavor and a Job
    that must stay in one rack: Kueue admits it on the exported flavor with a topology
    assignment down to the hostname, and its pods land in one rack."""
    env = {**os.environ, "KUBECONFIG": str(local.kubeconfig)}
    kubectl = [cluster.kubectl_path()]
    cluster.apply_crds(local, binaries.repo_root() / "crds")  # the peers' cluster has none
    _run([*kubectl, "apply", "-f", "-"], env, manifests.supernode("sn-0", spares=0).yaml())
    export = [sys.executable, "-m", "matrixpool.cli", "export", "topology", "--format", "kueue"]
    exported = _run([*export, "--prefix", "exported"], env).stdout
    _run([*kubectl, "apply", "--server-side", "-f", "-"], env, exported)
    objects = list(yaml.safe_load_all(exported))
    (flavor,) = [o["metadata"]["name"] for o in objects if o["kind"] == "ResourceFlavor"]
    (levels,) = [o["spec"]["levels"] for o in objects if o["kind"] == "Topology"]
    queue = _exported_queue(flavor)
    try:
        _run([*kubectl, "apply", "-f", "-"], env, yaml.safe_dump_all(queue))
        _run([*kubectl, "create", "-f", "-"], env, yaml.safe_dump(_rack_job("exp-rack", 4)))
        admission = framework.eventually(
            lambda: _admission(api, "exp-rack"), timeout=60, what="the Job's Workload admitted"
        )
        (assignment,) = admission["podSetAssignments"]
        assert assignment["flavors"] == {SHAPE.card_resource: flavor}
        assert assignment["topologyAssignment"]["levels"] == [levels[-1]["nodeLabel"]]
        assert len(assignment["topologyAssignment"]["slices"]) >= 1
        assert len(racks_when_bound(api, "exp-rack", 4)) == 1
    finally:
        leftovers = [_rack_job("exp-rack", 4), *queue, *objects]
        delete = [*kubectl, "delete", "--wait=false", "--ignore-not-found", "-f", "-"]
        _run(delete, env, yaml.safe_dump_all(leftovers))
        _run([*kubectl, "delete", "supernode", "sn-0", "--wait=false"], env)


def _rack_job(name: str, pods: int) -> dict[str, Any]:
    """A batch Job of ``pods`` whole-node pods in the exported LocalQueue, required in one rack
    (``kueue.x-k8s.io/podset-required-topology``), kept running by kwok."""
    cards = {SHAPE.card_resource: str(SHAPE.cards_per_node)}
    container = {
        "name": "w",
        "image": peers.IMAGE,
        "resources": {"requests": cards, "limits": cards},
    }
    annotations = {kueue.REQUIRED_TOPOLOGY: labels.RACK, **peers.RUN_FOREVER}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": peers.NAMESPACE,
            "labels": {kueue.QUEUE_LABEL: "exported"},
        },
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "completionMode": "Indexed",
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {peers.GANG_LABEL: name}, "annotations": annotations},
                "spec": {"restartPolicy": "Never", "containers": [container]},
            },
        },
    }


def _exported_queue(flavor: str) -> list[dict[str, Any]]:
    """A ClusterQueue holding every card on the exported flavor, and its LocalQueue."""
    cards = str(SHAPE.node_count * SHAPE.cards_per_node)
    resources = [{"name": SHAPE.card_resource, "nominalQuota": cards}]
    group = {
        "coveredResources": [SHAPE.card_resource],
        "flavors": [{"name": flavor, "resources": resources}],
    }
    return [
        {
            "apiVersion": kueue.API,
            "kind": "ClusterQueue",
            "metadata": {"name": "exported"},
            "spec": {"namespaceSelector": {}, "resourceGroups": [group]},
        },
        {
            "apiVersion": kueue.API,
            "kind": "LocalQueue",
            "metadata": {"name": "exported", "namespace": peers.NAMESPACE},
            "spec": {"clusterQueue": "exported"},
        },
    ]


def _admission(api: k8s_client.Api, job: str) -> dict[str, Any] | None:
    """The admission of the Workload Kueue made for a Job, once it is Admitted."""
    workloads = api.custom.list_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta2", peers.NAMESPACE, "workloads"
    )["items"]
    for workload in workloads:
        owners = [o["name"] for o in workload["metadata"].get("ownerReferences") or []]
        status = workload.get("status") or {}
        admitted = any(
            c["type"] == "Admitted" and c["status"] == "True"
            for c in status.get("conditions") or []
        )
        if job in owners and admitted:
            return dict(status["admission"])
    return None


def _run(
    argv: list[str], env: dict[str, str], input: str | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, env=env, input=input, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{argv[:4]} exit {done.returncode}: {done.stderr}"
    return done


def _scheduled_condition(api: k8s_client.Api, name: str) -> dict[str, Any] | None:
    group = api.custom.get_namespaced_custom_object(
        "scheduling.k8s.io", "v1beta1", peers.NAMESPACE, "podgroups", name
    )
    for condition in (group.get("status") or {}).get("conditions") or []:
        if condition["type"] == "PodGroupInitiallyScheduled":
            return dict(condition)
    return None
