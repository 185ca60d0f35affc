"""A TrainingJob's locality wait (``spec.placement.localityWaitSeconds``) on the real control
plane: a gang that the free cards would spread over more racks than the fewest that could hold
it waits (condition ``Scheduled=False``, reason ``WaitingForFewerRacks``); a rack that frees
meanwhile is taken whole, and once the wait is over it takes the racks that are free.

Each test uses a SuperNode ``sn-pre`` of two racks of ``sn-0`` (8 nodes × 8 cards, no spare),
filled by two 3-node gangs, one per rack: one node is free in each rack."""

from __future__ import annotations

import json
import time

from tests.integration import framework, manifests
from tests.integration.test_preemption_choice import (
    RACKS,
    condition,
    get_job,
    job_nodes,
    racks_of_nodes,
    run_bound,
    training,
)

WAITING = "WaitingForFewerRacks"


def one_node_free_per_rack(cluster: framework.TestCluster, namespace: str) -> dict[str, str]:
    """Two 3-node gangs, one per rack (``groupSize`` 3: each waits for a rack with 3 free nodes,
    also while the operator still counts the previous test's pods); the rack of each."""
    racks = racks_of_nodes(cluster)
    found = {}
    for name in ("left", "right"):
        job = training(name, 3, 10)
        job.body["spec"]["placement"]["groupSize"] = 3
        nodes = run_bound(cluster, namespace, job, 3)
        assert len({racks[n] for n in nodes}) == 1, f"{name} spans racks: {nodes}"
        found[name] = racks[nodes[0]]
    assert set(found.values()) == set(RACKS), found
    return found


def waiting(cluster: framework.TestCluster, namespace: str, name: str) -> bool:
    scheduled = condition(get_job(cluster, namespace, name), "Scheduled")
    return scheduled.get("status") == "False" and scheduled.get("reason") == WAITING


def bound_nodes(cluster: framework.TestCluster, namespace: str, name: str) -> list[str] | None:
    nodes = job_nodes(cluster, namespace, name)
    return nodes if nodes and all(nodes) else None


def pair(name: str, wait: int) -> manifests.TrainingJobManifest:
    job = training(name, 2, 10)
    job.body["spec"]["placement"]["localityWaitSeconds"] = wait
    return job


def test_a_rack_freed_during_the_wait_is_taken_whole(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    small_supernode: str,
) -> None:
    rack_of = one_node_free_per_rack(cluster, namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pair("pair", 600).yaml())
    framework.eventually(
        lambda: waiting(cluster, namespace, "pair"), timeout=30, what="pair waits for one rack"
    )
    assert job_nodes(cluster, namespace, "pair") == ["", ""]  # created, not bound
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"reason={WAITING}", "-o", "json"
    ).stdout
    assert any("pair" in e["involvedObject"]["name"] for e in json.loads(events)["items"])

    cluster.kubectl("delete", "trainingjob", "left", "-n", namespace)
    racks = racks_of_nodes(cluster)
    nodes = framework.eventually(
        lambda: bound_nodes(cluster, namespace, "pair"), timeout=60, what="pair bound"
    )
    assert {racks[n] for n in nodes} == {rack_of["left"]}


def test_once_the_wait_is_over_it_takes_the_racks_that_are_free(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    namespace: str,
    small_supernode: str,
) -> None:
    one_node_free_per_rack(cluster, namespace)
    applied = time.monotonic()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=pair("brief", 3).yaml())
    framework.eventually(
        lambda: waiting(cluster, namespace, "brief"), timeout=30, what="brief waits"
    )
    racks = racks_of_nodes(cluster)
    nodes = run_bound(cluster, namespace, pair("brief", 3), 2)
    assert time.monotonic() - applied >= 3.0
    assert {racks[n] for n in nodes} == set(RACKS)
    assert condition(get_job(cluster, namespace, "brief"), "Scheduled").get("status") == "True"
