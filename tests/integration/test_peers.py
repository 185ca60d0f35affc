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
    env = _env(local)
    kubectl = [cluster.kubectl_path()]
    exported = _export(local, "kueue", "--prefix", "exported")
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


def test_exported_volcano_hypernodes_pass_the_hypernode_crd_of_volcano(
    local: cluster.Cluster, api: k8s_client.Api
) -> None:
    """``matrixpool export topology --format volcano`` applied against Volcano's HyperNode CRD,
    generated from volcano.sh/apis v1.14.0 by tools/k8s/volcano-crd.sh: the API server takes
    sn-0 (tier 2) over its 12 racks (tier 1, 4 nodes each by name), and refuses a member with
    no selector (the CRD's CEL rules are live). Volcano itself does not run here: its webhook's
    rule (exactMatch or regexMatch only) is checked in tests/unit/interop."""
    env, kubectl = _env(local), [cluster.kubectl_path()]
    script = binaries.repo_root() / "tools" / "k8s" / "volcano-crd.sh"
    folder = Path(_run(["bash", str(script)], env).stdout.split()[-1])
    cluster.apply_crds(local, folder / "crd")
    exported = _export(local, "volcano")
    try:
        _run([*kubectl, "apply", "--server-side", "-f", "-"], env, exported)
        stored = api.custom.list_cluster_custom_object(
            "topology.volcano.sh", "v1alpha1", "hypernodes"
        )["items"]
        tiers = {h["metadata"]["name"]: h["spec"]["tier"] for h in stored}
        assert tiers == {"sn-0": 2, **{f"sn-0-rack-{r}": 1 for r in range(12)}}
        rack = next(h for h in stored if h["metadata"]["name"] == "sn-0-rack-3")
        names = [m["selector"]["exactMatch"]["name"] for m in rack["spec"]["members"]]
        assert names == [f"sn-0-node-{n:02d}" for n in range(12, 16)]
        broken = {**rack, "metadata": {"name": "broken"}}
        broken["spec"] = {**rack["spec"], "members": [{"type": "Node", "selector": {}}]}
        refused = subprocess.run(
            [*kubectl, "apply", "--server-side", "-f", "-"],
            env=env,
            input=yaml.safe_dump(broken),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode != 0
        assert "Either ExactMatch or RegexMatch or LabelMatch must be specified" in refused.stderr
    finally:
        delete = [*kubectl, "delete", "--wait=false", "--ignore-not-found", "-f", "-"]
        _run(delete, env, exported)


def _env(local: cluster.Cluster) -> dict[str, str]:
    return {**os.environ, "KUBECONFIG": str(local.kubeconfig)}


def _export(local: cluster.Cluster, fmt: str, *options: str) -> str:
    """``matrixpool export topology`` over SuperNode sn-0 (the CRDs and sn-0 applied first: the
    peers' cluster starts without them)."""
    env = _env(local)
    cluster.apply_crds(local, binaries.repo_root() / "crds")
    sn0 = manifests.supernode("sn-0", spares=0).yaml()
    _run([cluster.kubectl_path(), "apply", "-f", "-"], env, sn0)
    export = [sys.executable, "-m", "matrixpool.cli", "export", "topology", "--format", fmt]
    return _run([*export, *options], env).stdout


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
