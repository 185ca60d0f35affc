"""The peers of benchmarks/peers.py run for real on the local control plane (``cluster up
--peers``): kube-scheduler's own gang scheduling with a topology constraint (PodGroup,
scheduling.k8s.io/v1beta1) and Kueue's Topology Aware Scheduling, each given a gang exactly as
the benchmark gives it. A cluster of its own: 1 supernode of 48 kwok nodes, racks of 4."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import peers
from matrixpool.api import labels
from matrixpool.devcluster import cluster, topology
from matrixpool.k8s import client as k8s_client
from tests.integration import framework

SHAPE = topology.Shape(supernodes=1)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[k8s_client.Api]:
    local = cluster.Cluster(Path(tmp_path_factory.mktemp("peers")), tied=True)
    try:
        local.up(SHAPE, peers=True)
        client = k8s_client.from_kubeconfig(local.kubeconfig)
        peers.prepare(client, SHAPE)
        yield client
    finally:
        local.down()


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


def _scheduled_condition(api: k8s_client.Api, name: str) -> dict[str, Any] | None:
    group = api.custom.get_namespaced_custom_object(
        "scheduling.k8s.io", "v1beta1", peers.NAMESPACE, "podgroups", name
    )
    for condition in (group.get("status") or {}).get("conditions") or []:
        if condition["type"] == "PodGroupInitiallyScheduled":
            return dict(condition)
    return None
