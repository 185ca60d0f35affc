"""Reschedule to a second SuperNode of real nodes (issue 32, item 3): the example PyTorch trainer
(gloo, DCP on matrixpool_recovery.torch) as one rank on sn-real, ``superNodeAffinity:
Preferred``, beside sn-real-b, a SuperNode of one real node (real-2, taken out of sn-real for the
test by its labels).

Every checkpoint daemon of sn-real becomes unreachable at once: each node's network namespace
refuses the daemon's port to every address but the node's own (iptables), so the operator, the
peers and every other node lose them, while their kubelets (which probe them from the node)
keep them running. Tier 1 and every peer copy are behind that wall, spares included: the
recovery is a Reschedule (cause DaemonUnreachable) onto sn-real-b, whose daemon reads tier 3
from the shared file system, and the rank restores the newest step tier 3 holds. The job
Succeeds with the parameters, bitwise, of a run without the fault."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from matrixpool.api import labels
from matrixpool.devcluster import realnodes
from tests.integration import framework
from tests.realnodes.conftest import (
    REAL_SUPERNODE,
    SPARE,
    EndedPods,
    Watched,
    ends_as,
    running,
    supernode,
)
from tests.realnodes.test_pytorch_on_real_nodes import job, reference
from tests.realnodes.test_regroup_on_real_nodes import restored_and_stepping

JOB = "torch-moved"
STEPS = 70  # a step every 0.5 s
OTHER = "sn-real-b"
MOVED_TO = "real-2"  # sn-real-b's one node; sn-real keeps real-0, real-1 and its spare real-3


def moving() -> dict[str, Any]:
    """The example trainer's job, one rank on sn-real that may go to another SuperNode."""
    body = job(JOB, ranks=1, steps=STEPS, step_seconds=0.5)
    body["spec"]["placement"] = {"superNodeAffinity": "Preferred"}
    return body


def relabel(cluster: framework.TestCluster, node: str, supernode_name: str, rack: str) -> None:
    patch = {"metadata": {"labels": {labels.SUPERNODE: supernode_name, labels.RACK: rack}}}
    cluster.kubectl("patch", "node", node, "--type=merge", "-p", json.dumps(patch))


@pytest.fixture
def two_supernodes(installed: framework.TestCluster) -> Iterator[framework.TestCluster]:
    """sn-real less real-2, and sn-real-b of real-2 alone; sn-real whole again after."""
    cluster = installed
    cluster.kubectl("apply", "-f", "-", input=json.dumps(supernode()))
    other = supernode()
    other["metadata"]["name"] = OTHER
    other["spec"]["nodeSelector"] = {"matchLabels": {labels.SUPERNODE: OTHER}}
    other["spec"]["spares"] = {"nodes": 0}
    relabel(cluster, MOVED_TO, OTHER, f"{OTHER}-rack-0")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(other))
    try:
        yield cluster
    finally:
        cluster.kubectl("delete", "supernode", OTHER, "--wait=false", check=False)
        index = int(MOVED_TO.removeprefix(realnodes.NODE_PREFIX))
        home = realnodes.node_labels(index, 2, REAL_SUPERNODE)
        relabel(cluster, MOVED_TO, REAL_SUPERNODE, home[labels.RACK])


def cut_off(cluster: framework.TestCluster, node: str, *, undo: bool = False) -> None:
    """Refuse (or, ``undo``, accept again) TCP to ``node``'s daemon port from any address but
    the node's own, in its network namespace."""
    body = json.loads(cluster.kubectl("get", "node", node, "-o", "json").stdout)
    [own] = [a["address"] for a in body["status"]["addresses"] if a["type"] == "InternalIP"]
    rule = ["-p", "tcp", "--dport", str(labels.DAEMON_PORT), "!", "-s", own]
    rule += ["-j", "REJECT", "--reject-with", "tcp-reset"]
    args = ["iptables", "-D", "INPUT", *rule] if undo else ["iptables", "-I", "INPUT", *rule]
    done = cluster.local.run_on_real_node(node, *args)
    assert done.returncode == 0 or undo, done.stderr


def test_a_job_whose_supernodes_daemons_are_all_lost_moves_to_another_and_restores_tier_3(
    two_supernodes: framework.TestCluster, namespace: str
) -> None:
    cluster = two_supernodes
    assert running(cluster, "operator")[0]["spec"]["nodeName"] == SPARE
    watched = Watched(cluster, namespace, JOB)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(moving()))
    members = sorted(
        n["metadata"]["name"]
        for n in json.loads(
            cluster.kubectl(
                "get", "nodes", "-l", f"{labels.SUPERNODE}={REAL_SUPERNODE}", "-o", "json"
            ).stdout
        )["items"]
    )
    assert MOVED_TO not in members
    assert SPARE in members
    with EndedPods(cluster, namespace):
        watched.training(past=6)
        framework.eventually(
            lambda: (watched.status().get("checkpoints") or {}).get("persistent"),
            timeout=120,
            interval=0.5,
            what="a step on tier 3",
        )
        [first] = [p["spec"]["nodeName"] for p in watched.rank_pods().values()]
        assert first in members, first
        for node in members:
            cut_off(cluster, node)
        try:
            entry = watched.recovered(1)
            print("recovery:", entry)
            assert entry["level"] == "Reschedule", entry
            assert entry["cause"].startswith("DaemonUnreachable"), entry
            assert not entry.get("fromScratch"), entry  # tier 3 held a step
            placed = watched.status()["placement"]
            assert placed["superNode"] == OTHER, placed
            [pod] = watched.rank_pods().values()
            assert pod["spec"]["nodeName"] == MOVED_TO
            ranks = framework.eventually(
                lambda: restored_and_stepping(cluster, namespace, entry["id"], 1, job=JOB),
                timeout=180,
                interval=2,
                what="the rank restores the recovery's step and steps on",
            )
            assert ranks[0][0] == entry["restoredStep"], (ranks, entry)
            restore = [
                json.loads(line)
                for line in cluster.kubectl(
                    "logs", "-n", namespace, pod["metadata"]["name"]
                ).stdout.splitlines()
                if line.startswith("{") and '"restored"' in line
            ]
            print("restore:", restore)
            assert restore[-1]["source"] == "persistent", restore
        finally:
            for node in members:
                cut_off(cluster, node, undo=True)
        made = reference(namespace, SPARE, steps=STEPS, ranks=1, name="moved-reference")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(made))
        watched.succeeded()
    assert len(watched.status().get("recoveries") or []) == 1
    ends_as(cluster, namespace, watched, "moved-reference", 1, STEPS)
