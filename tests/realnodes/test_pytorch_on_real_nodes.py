"""A PyTorch job on real nodes (issue 14): the example trainer (matrixpool.devcluster.torch_trainer,
gloo across ranks on two nodes that meet at MASTER_ADDR, rank 0's name in the job's headless
Service; model and Adam state through DCP on matrixpool_recovery.torch) in containers of
the image built here, through a killed trainer container (InPlace) and a stopped kubelet (its
node's Lease goes stale: SpareSwap onto the spare real node), to Succeeded; the parameters at
the last step are bitwise those of a run that never failed."""

from __future__ import annotations

import json
from typing import Any

from tests.integration import framework
from tests.realnodes.conftest import (
    IMAGE,
    REAL_SUPERNODE,
    SPARE,
    Watched,
    last_line,
    running,
    supernode,
)

JOB = "torch-mlp"
STEPS = 80
RANKS = 2
PERSISTENT = "/var/lib/matrixpool/persistent"  # the chart's persistentPath


def job() -> dict[str, Any]:
    """Two ranks of 8 cards (one per node), a step every ~1 s (a stopped kubelet shows in its
    Lease after 20 s, then the recovery runs: training must outlast both), checkpoints every 2
    steps in memory (one peer copy) and every 4 on tier 3."""
    env = {
        "MATRIXPOOL_SIM_STEPS": str(STEPS),
        "MATRIXPOOL_SIM_STEP_SECONDS": "1.0",
        "MATRIXPOOL_TORCH_TIMEOUT_SECONDS": "240",
    }
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": JOB},
        "spec": {
            "superNode": REAL_SUPERNODE,
            "replicas": RANKS,
            "cardsPerReplica": 8,
            "template": {
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["python", "-m", "matrixpool.devcluster.torch_trainer"],
                            "env": [{"name": k, "value": v} for k, v in env.items()],
                        }
                    ],
                }
            },
            "checkpoint": {
                "memory": {"everySteps": 2, "peerReplicas": 1},
                "persistent": {"everySteps": 4, "uri": f"file://{PERSISTENT}/{JOB}"},
            },
        },
    }


def reference(cluster: framework.TestCluster, namespace: str, node: str) -> dict[str, Any]:
    """A pod computing the fault-free run's digest in one process (same seed, width, steps)."""
    code = (
        "import json\n"
        "from matrixpool.devcluster import torch_trainer as t\n"
        f"print(json.dumps({{'digest': t.reference_digest({STEPS}, {RANKS})}}))\n"
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "torch-reference", "namespace": namespace},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "reference",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", code],
                }
            ],
        },
    }


def test_a_pytorch_job_recovers_on_real_nodes_to_the_parameters_of_a_fault_free_run(
    installed: framework.TestCluster,
    namespace: str,
) -> None:
    cluster = installed
    watched = Watched(cluster, namespace, JOB)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(supernode()))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(job()))
    watched.training(past=4)
    operator_node = running(cluster, "operator")[0]["spec"]["nodeName"]
    pods = watched.rank_pods()
    assert len({p["spec"]["nodeName"] for p in pods.values()}) == RANKS  # 8 cards: a node each
    for pod in pods.values():  # the device plugin gave each rank the cards the operator chose
        annotations = pod["metadata"]["annotations"]
        assert (
            annotations["deviceplugin.matrixpool.dev/allocated-cards"]
            == (annotations["matrixpool.dev/cards"])
        ), annotations
    spare = SPARE
    assert spare not in {p["spec"]["nodeName"] for p in pods.values()}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(reference(cluster, namespace, spare)))

    # 1. A trainer container is killed: its rank restarts in place from its node's memory.
    victim = pods[1]
    container = victim["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
    cluster.local.kill_container(victim["spec"]["nodeName"], container)
    entry = watched.recovered(1)
    assert entry["level"] == "InPlace", entry
    assert entry["ranks"] == [1], entry

    # 2. A node's kubelet stops (its containers go on running, unseen): the node's Lease goes
    #    stale and the rank on it moves to the spare real node.
    watched.training(past=entry["restoredStep"] + 2)
    pods = watched.rank_pods()
    rank, node = next(
        (r, p["spec"]["nodeName"])
        for r, p in sorted(pods.items())
        if p["spec"]["nodeName"] != operator_node
    )
    cluster.local.stop_kubelet(node)
    try:
        entry = watched.recovered(2)
        assert entry["level"] == "SpareSwap", entry
        assert entry["ranks"] == [rank], entry
        moved = watched.rank_pods()[rank]
        assert moved["spec"]["nodeName"] == spare, moved["spec"]["nodeName"]

        # 3. To the end: Succeeded, every rank's parameters those of the fault-free run.
        framework.eventually(
            lambda: watched.status().get("phase") == "Succeeded",
            timeout=300,
            interval=1,
            what=f"{JOB} Succeeded",
        )
    finally:
        cluster.local.start_kubelet(node)
    final = {
        r: last_line(cluster, namespace, p["metadata"]["name"])
        for r, p in watched.rank_pods().items()
    }
    expected = framework.eventually(
        lambda: last_line(cluster, namespace, "torch-reference").get("digest"),
        timeout=240,
        what="the fault-free digest",
    )
    for r, line in final.items():
        assert line.get("finished") is True, (r, line)
        assert line["digest"] == expected, (r, line, expected)
