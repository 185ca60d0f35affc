"""A PyTorch job on real nodes (issue 14): the example trainer (matrixpool.devcluster.torch_trainer,
gloo across ranks on two nodes that meet at MASTER_ADDR, rank 0's name in the job's headless
Service; model and Adam state through DCP on matrixpool_recovery.torch) in containers of
the image built here, through a killed trainer container (InPlace) and a stopped kubelet (its
node's Lease goes stale: SpareSwap onto the spare real node), to Succeeded; the parameters at
the last step are bitwise those of a run that never failed."""

from __future__ import annotations

import base64
import json
from typing import Any

from matrixpool_recovery import credentials
from tests.integration import chart, framework
from tests.realnodes.conftest import (
    IMAGE,
    REAL_SUPERNODE,
    SPARE,
    Watched,
    ends_as,
    last_line,
    running,
    supernode,
)

JOB = "torch-mlp"
STEPS = 80
RANKS = 2
PERSISTENT = "/var/lib/matrixpool/persistent"  # the chart's persistentPath


def job(
    name: str = JOB, *, ranks: int = RANKS, steps: int = STEPS, step_seconds: float = 1.0
) -> dict[str, Any]:
    """``ranks`` ranks of 8 cards (one per node), ``steps`` steps, a step every
    ``step_seconds`` (here ~1 s: a stopped kubelet shows in its Lease after 20 s, then the
    recovery runs: training must outlast both), checkpoints every 2 steps in memory (one peer
    copy) and every 4 on tier 3, under ``PERSISTENT/<name>``."""
    env = {
        "MATRIXPOOL_SIM_STEPS": str(steps),
        "MATRIXPOOL_SIM_STEP_SECONDS": str(step_seconds),
        "MATRIXPOOL_TORCH_TIMEOUT_SECONDS": "240",
    }
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "superNode": REAL_SUPERNODE,
            "replicas": ranks,
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
                "persistent": {"everySteps": 4, "uri": f"file://{PERSISTENT}/{name}"},
            },
        },
    }


def reference(
    namespace: str,
    node: str,
    *,
    steps: int = STEPS,
    ranks: int = RANKS,
    regroups: list[tuple[int, int]] | None = None,
    name: str = "torch-reference",
) -> dict[str, Any]:
    """A pod computing the fault-free run's digest in one process (same seed, width, steps;
    with ``regroups``, the same world schedule: ``torch_trainer.reference_digest``)."""
    code = (
        "import json\n"
        "from matrixpool.devcluster import torch_trainer as t\n"
        f"d = t.reference_digest({steps}, {ranks}, regroups={regroups or []!r})\n"
        "print(json.dumps({'digest': d}))\n"
    )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
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


PROBE = """
import json, os, sys
from pathlib import Path
from matrixpool_recovery import errors, fdpass
job, other, mine, theirs, step = sys.argv[1:6]
folder = Path(os.environ["SOCKET_FOLDER"])
sock = folder / fdpass.SOCKET_NAME
def ask(token, name, **request):
    try:
        answer, fd = fdpass.ask(sock, {"token": token, "job": name, **request})
    except errors.CheckpointError as err:
        return getattr(err, "status", 0)
    if fd is not None:
        os.close(fd)
        return "handed"
    return "answered"
shard = {"open": "shard", "rank": 0, "step": int(step)}
print(json.dumps({
    "socket_folder": sorted(os.listdir(folder)),
    "memory_folder": os.path.exists("/dev/shm/matrixpool/buffers"),
    "their_shard_with_my_token": ask(mine, job, **shard),
    "their_shard_as_my_job": ask(mine, other, **shard),
    "my_own_probe": ask(mine, other, open="probe"),
    "their_shard_with_their_token": ask(theirs, job, **shard),
}))
"""


def other_jobs_pod(
    cluster: framework.TestCluster, namespace: str, node: str, args: list[str]
) -> dict[str, Any]:
    """A pod of another tenant on ``node`` that mounts the daemon's socket folder as a trainer
    pod does (issue 31, finding 2), holding another job's token and, for contrast, the first
    job's: what it may open of the first job's tier 1."""
    folder = "/dev/shm/matrixpool/socket"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "other-job", "namespace": namespace},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "volumes": [{"name": "socket", "hostPath": {"path": folder, "type": "Directory"}}],
            "containers": [
                {
                    "name": "probe",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", PROBE, *args],
                    "env": [{"name": "SOCKET_FOLDER", "value": folder}],
                    "volumeMounts": [{"name": "socket", "mountPath": folder, "readOnly": True}],
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
    # Another job's pod on rank 0's node, mounting what a trainer pod mounts, opens nothing of
    # this job's tier 1 with its own job's token; this job's token opens its shard there.
    secret = cluster.api.core.read_namespaced_secret(f"{chart.RELEASE}-checkpoint", chart.SYSTEM)
    cluster_secret = base64.b64decode(secret.data["token"]).decode().strip()
    uid = pods[0]["metadata"]["labels"]["matrixpool.dev/job-uid"]
    step = watched.training(past=4)["checkpoints"]["memory"]
    other = "0b1e5a3c-0000-4000-8000-000000000001"  # another TrainingJob's UID
    tokens = [credentials.job_token(cluster_secret, j) for j in (other, uid)]
    node = pods[0]["spec"]["nodeName"]
    probe = other_jobs_pod(cluster, namespace, node, [uid, other, *tokens, str(step)])
    cluster.kubectl("apply", "-f", "-", input=json.dumps(probe))
    seen = framework.eventually(
        lambda: last_line(cluster, namespace, "other-job") or None, timeout=120, what="the probe"
    )
    assert seen == {
        "socket_folder": ["daemon.sock"],
        "memory_folder": False,
        "their_shard_with_my_token": 403,
        "their_shard_as_my_job": 404,
        "my_own_probe": "answered",
        "their_shard_with_their_token": "handed",
    }, seen

    spare = SPARE
    assert spare not in {p["spec"]["nodeName"] for p in pods.values()}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(reference(namespace, spare)))

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
        watched.succeeded()
    finally:
        cluster.local.start_kubelet(node)
    ends_as(cluster, namespace, watched, "torch-reference", RANKS)
