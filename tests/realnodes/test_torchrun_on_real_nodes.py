"""A user's PyTorch job on real nodes (issue 30, acceptance 1 and 4): examples/pytorch-ddp.yaml as
shipped — its ConfigMap'd script run by ``torchrun`` with no flags, rendezvous through the names
of the job's headless Service, checkpoints through ``torch.distributed.checkpoint`` and
matrixpool_recovery.torch — 3 ranks on 3 real nodes, the fourth kept spare. Rank 0's node loses
its power: SpareSwap, rank 0 comes back on the spare under the same name (a pod resolves it to
the new address, no ``kubectl exec``), every rank rejoins and restores, rank 0 from the peer copy
of a node that died. Then a trainer container is killed: InPlace. The job Succeeds with every
rank's parameters bitwise those of a fault-free ``torchrun --standalone`` run of the same script.

Changed from the example, as a user would for this cluster: the SuperNode, the image pull policy
(no registry here), the step count and pace (training must outlast two recoveries), and the
checkpoint schedule (every 5 steps in memory, every 20 on tier 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.integration import framework
from tests.realnodes.conftest import (
    IMAGE,
    REAL_NODES,
    REAL_SUPERNODE,
    SPARE,
    EndedPods,
    Watched,
    last_line,
    running,
    supernode,
)
from tests.trainlogs import DIGEST, first_difference, losses, merged

EXAMPLE = Path(__file__).parents[2] / "examples" / "pytorch-ddp.yaml"
JOB = "pytorch-ddp"
RANKS = 3
STEPS = 240
KNOBS = {"STEPS": str(STEPS), "SAVE_EVERY": "5", "STEP_SECONDS": "0.3"}
PERSISTENT = "/var/lib/matrixpool/persistent"  # the chart's persistentPath


def example() -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's ConfigMap and TrainingJob, the job changed only as the docstring says."""
    documents = list(yaml.safe_load_all(EXAMPLE.read_text()))
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    job = next(d for d in documents if d["kind"] == "TrainingJob")
    spec = job["spec"]
    spec["superNode"] = REAL_SUPERNODE
    pod = spec["template"]["spec"]
    pod["terminationGracePeriodSeconds"] = 2
    [trainer] = pod["containers"]
    assert trainer["command"] == ["torchrun", "/opt/train/ddp.py"]  # as shipped, no flags
    trainer["image"], trainer["imagePullPolicy"] = IMAGE, "Never"
    trainer["env"] = [{"name": k, "value": v} for k, v in KNOBS.items()]
    spec["checkpoint"] = {
        "memory": {"everySteps": 5, "peerReplicas": 1},
        "persistent": {"everySteps": 20, "uri": f"file://{PERSISTENT}/{JOB}"},
    }
    assert spec["recovery"]["restart"] == "Gang"
    return config_map, job


def reference(namespace: str, node: str) -> dict[str, Any]:
    """The fault-free run: the same script by ``torchrun --standalone --nproc-per-node=3`` in
    one pod (the same world of 3 ranks), nothing saved."""
    env = KNOBS | {"SAVE_EVERY": "0", "STEP_SECONDS": "0"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "ddp-reference", "namespace": namespace},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "reference",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [
                        "torchrun",
                        "--standalone",
                        f"--nproc-per-node={RANKS}",
                        "/opt/train/ddp.py",
                    ],
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                    "volumeMounts": [{"name": "train", "mountPath": "/opt/train"}],
                }
            ],
            "volumes": [{"name": "train", "configMap": {"name": JOB}}],
        },
    }


def resolver(namespace: str, node: str, name: str) -> dict[str, Any]:
    """A pod that resolves ``name`` as any pod of the cluster would and says what it got."""
    look = f"for _ in $(seq 150); do getent hosts {name} && break; sleep 0.2; done"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "resolver", "namespace": namespace},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "getent",
                    "image": IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", f"({look}) > /dev/termination-log"],
                }
            ],
        },
    }


def terminated(cluster: framework.TestCluster, namespace: str, pod: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        out = cluster.kubectl("get", "pod", pod, "-n", namespace, "-o", "json", check=False)
        if out.returncode:
            return None
        statuses = json.loads(out.stdout)["status"].get("containerStatuses") or []
        return statuses[0]["state"].get("terminated") if statuses else None

    return framework.eventually(probe, timeout=180, what=f"{pod} ended")


def test_a_torchrun_job_recovers_from_a_power_cut_and_a_crash_to_the_fault_free_parameters(
    installed: framework.TestCluster, namespace: str
) -> None:
    cluster = installed
    assert running(cluster, "operator")[0]["spec"]["nodeName"] == SPARE
    config_map, job = example()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(supernode()))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(config_map))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(job))
    cluster.kubectl("apply", "-f", "-", input=json.dumps(reference(namespace, SPARE)))
    with EndedPods(cluster, namespace) as ended:
        run_through_faults(cluster, namespace, ended)


def run_through_faults(cluster: framework.TestCluster, namespace: str, ended: EndedPods) -> None:
    watched = Watched(cluster, namespace, JOB)
    watched.training(past=5)

    pods = watched.rank_pods()
    nodes = {r: p["spec"]["nodeName"] for r, p in pods.items()}
    assert sorted(nodes) == list(range(RANKS))
    assert set(nodes.values()) == {f"real-{i}" for i in range(REAL_NODES)} - {SPARE}
    fqdn = f"{JOB}-0.{JOB}.{namespace}.svc.cluster.local"
    for rank, pod in pods.items():
        assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == (f"{JOB}-{rank}", JOB)
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert (env["PET_MASTER_ADDR"], env["PET_NODE_RANK"]) == (fqdn, str(rank))
        annotations = pod["metadata"]["annotations"]  # the device plugin gave the chosen cards
        assert (
            annotations["deviceplugin.matrixpool.dev/allocated-cards"]
            == (annotations["matrixpool.dev/cards"])
        )

    # 1. Rank 0's node loses its power (its daemon and tier 1 with it): the daemon stops
    #    answering, rank 0 moves to the spare and every rank restarts from the last step all
    #    committed, rank 0 from the peer copy another node holds.
    lost = nodes[0]
    cluster.matrixpool("cluster", "fault", "power-off", lost)
    try:
        entry = watched.recovered(1)
        assert entry["level"] == "SpareSwap", entry
        # The others' collectives failed at once (their peer's address is gone: no route), so
        # their pods failed too and the entry lists them; they restart on their own nodes.
        assert 0 in entry["ranks"], entry
        swapped = entry["restoredStep"]
        assert swapped >= 5, entry
        watched.training(past=swapped + 2)
        pods = watched.rank_pods()
        assert pods[0]["spec"]["nodeName"] == SPARE
        assert {r: pods[r]["spec"]["nodeName"] for r in (1, 2)} == {r: nodes[r] for r in (1, 2)}
        assert pods[0]["spec"]["hostname"] == f"{JOB}-0"
        for rank, pod in pods.items():  # every rank rejoined from the same step
            restored = [
                line
                for line in cluster.kubectl(
                    "logs", "-n", namespace, pod["metadata"]["name"]
                ).stdout.splitlines()
                if '"restored"' in line
            ]
            assert [json.loads(x)["restored"] for x in restored] == [swapped], (rank, restored)

        # The same name leads to rank 0 on the spare, as a pod of the cluster resolves it.
        cluster.kubectl("apply", "-f", "-", input=json.dumps(resolver(namespace, nodes[1], fqdn)))
        said = terminated(cluster, namespace, "resolver")
        assert said.get("message", "").split() == [pods[0]["status"]["podIP"], fqdn], said

        # 2. A trainer container is killed: its rank's pod fails, the gang restarts in place.
        victim = pods[1]
        container = victim["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
        cluster.local.kill_container(victim["spec"]["nodeName"], container)
        entry = watched.recovered(2)
        assert entry["level"] == "InPlace", entry
        assert 1 in entry["ranks"], entry
        assert entry["restoredStep"] > swapped, entry

        # 3. To the end: Succeeded, every rank's parameters those of the fault-free run.
        watched.succeeded()
    finally:
        cluster.matrixpool("cluster", "fault", "power-on", lost, check=False)
    final = {
        r: last_line(cluster, namespace, p["metadata"]["name"])
        for r, p in watched.rank_pods().items()
    }
    assert terminated(cluster, namespace, "ddp-reference").get("exitCode") == 0
    reference_log = cluster.kubectl("logs", "-n", namespace, "ddp-reference").stdout
    [expected] = set(DIGEST.findall(reference_log))  # torchrun's workers share one stdout
    assert sorted(final) == list(range(RANKS))
    for rank, line in final.items():
        assert line.get("finished") is True, (rank, line)
        assert line["step"] == STEPS, (rank, line)
    [digest] = {line["digest"] for line in final.values()}  # DDP: every rank's parameters alike
    ranks = [
        cluster.kubectl("logs", "-n", namespace, p["metadata"]["name"]).stdout
        for p in watched.rank_pods().values()
    ]
    printed = merged(*(losses(log) for log in [*ended.logs.values(), *ranks]))
    where = first_difference(printed, losses(reference_log))
    assert digest == expected, f"parameters differ from the fault-free run's: {where}"
