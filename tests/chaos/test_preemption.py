"""Checkpoint-aware priority preemption (issue 12) on the real control plane, with
``matrixpool sim`` playing kubelets and trainers: a training job that a higher priority
preempts is asked to checkpoint first, gives up its cards once it answered, says so in its
Preempted condition and its ``status.preemptions`` record, and later resumes from the step
it saved, or a newer one its trainers committed before they stopped (the record then says
when, and which step). An elastic job shrinks instead, and grows back once the cards are free:
both size changes regroup the whole gang (issue 32), every rank of the new world restoring the
same step and stepping on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tests.chaos.test_recovery import JOB, start_job, status, wait_training
from tests.integration import chart, framework, manifests


def condition(current: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in current.get("conditions") or [] if c["type"] == type_), {})


def test_a_preempted_training_job_checkpoints_first_and_resumes_from_that_step(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path, replicas=4, supernode="sn-0")
    wait_training(cluster, namespace, past=4)
    # All but the spare are usable on sn-0; the job holds 4: a service taking every other
    # node and one more preempts it.
    usable = cluster.shape.nodes_per_supernode - 1
    service = manifests.inference_service("chat", "sn-0").role("serve", replicas=1, pods=usable - 3)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=service.yaml())

    def evicted() -> dict[str, Any] | None:
        preempted = condition(status(cluster, namespace), "Preempted")
        return preempted if preempted.get("status") == "True" else None

    preempted = framework.eventually(evicted, timeout=120, what=f"{JOB} preempted")
    print(preempted)
    answered = re.search(r"checkpoint answered at step (\d+)", preempted["message"])
    assert answered, f"the eviction waited for the checkpoint: {preempted['message']}"
    step = int(answered.group(1))
    reasons = {
        e["reason"]
        for e in cluster.api.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={JOB}"
        ).to_dict()["items"]
    }
    assert "CheckpointRequested" in reasons, reasons
    (record,) = status(cluster, namespace)["preemptions"]
    assert (record["checkpoint"], record["step"]) == ("Answered", step), record
    assert record["by"].startswith(f"{namespace}/chat/"), record

    cluster.kubectl("delete", "inferenceservice", "chat", "-n", namespace)
    framework.eventually(
        lambda: condition(status(cluster, namespace), "Preempted").get("status") == "False",
        timeout=120,
        what=f"{JOB} bound again",
    )
    (closed,) = framework.eventually(
        lambda: [p for p in status(cluster, namespace)["preemptions"] if p.get("resumedAt")],
        what="the preemption record closed",
    )
    # The new pods restore the newest step every rank committed once the evicted pods were
    # gone: the answer, or a step the trainers saved after it during their eviction.
    restored = closed["restoredStep"]
    assert restored >= step, closed
    for rank in range(4):
        lines = framework.eventually(
            lambda rank=rank: [
                line
                for line in sim.trainer_lines(namespace, f"{JOB}-{rank}")
                if line.get("asked") and "preempt-" in str(line["asked"])
            ],
            timeout=90,
            what=f"rank {rank} resumes",
        )
        assert lines[-1].get("restored") == restored, lines[-1]
        assert lines[-1]["intact"] is True, lines[-1]


def resize_to(cluster: framework.TestCluster, namespace: str, size: int) -> dict[str, Any] | None:
    """The newest finished regroup of the job to ``size`` ranks, once there is one."""
    done = [
        r
        for r in status(cluster, namespace).get("resizes") or []
        if r.get("finishedAt") and r["toReplicas"] == size
    ]
    return done[-1] if done else None


def stepped_on(sim: framework.Sim, namespace: str, rank: int, tag: str) -> tuple[int, int] | None:
    """(the step ``rank`` restored for regroup ``tag``, the newest step it made since), once it
    made two more; None before."""
    restored, newest = None, -1
    for line in sim.trainer_lines(namespace, f"{JOB}-{rank}"):
        if line.get("recovery") == tag and line.get("restored") is not None:
            assert line["intact"] is True, line
            restored, newest = int(line["restored"]), -1
        elif restored is not None and "restored" not in line and "step" in line:
            newest = max(newest, int(line["step"]))
    return (restored, newest) if restored is not None and newest >= restored + 2 else None


def assert_regrouped(sim: framework.Sim, namespace: str, resize: dict[str, Any]) -> None:
    tag, size = f"resize-{resize['id']}", resize["toReplicas"]
    for rank in range(size):
        restored, newest = framework.eventually(
            lambda rank=rank: stepped_on(sim, namespace, rank, tag),
            timeout=60,
            what=f"rank {rank} of {size} restores and steps on after {tag}",
        )
        assert restored == resize["restoredStep"], (rank, restored, resize)
        print(f"rank {rank}/{size}: restored {restored}, now at step {newest}")


def test_an_elastic_job_shrinks_for_a_higher_priority_and_grows_back_every_rank_stepping_on(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path, replicas=4, minimum=2, supernode="sn-0")
    wait_training(cluster, namespace, past=4)
    usable = cluster.shape.nodes_per_supernode - 1  # the job's 4 nodes and 11 free: 13 take 2
    service = manifests.inference_service("chat", "sn-0").role("serve", replicas=1, pods=usable - 2)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=service.yaml())

    shrunk = framework.eventually(
        lambda: resize_to(cluster, namespace, 2), timeout=120, what=f"{JOB} regrouped at 2"
    )
    print("shrink:", shrunk)
    assert (shrunk["fromReplicas"], shrunk["reason"]) == (4, "Preemption"), shrunk
    (record,) = status(cluster, namespace)["preemptions"]
    assert record["replicasKept"] == 2, record
    # every rank of the new world restored the newest step all 4 old ranks committed
    assert shrunk["restoredStep"] >= record["step"], (shrunk, record)
    assert_regrouped(sim, namespace, shrunk)

    cluster.kubectl("delete", "inferenceservice", "chat", "-n", namespace)
    grown = framework.eventually(
        lambda: resize_to(cluster, namespace, 4), timeout=120, what=f"{JOB} regrouped at 4"
    )
    print("grow:", grown)
    assert (grown["fromReplicas"], grown["reason"]) == (2, "Replicas"), grown
    assert grown["restoredStep"] > shrunk["restoredStep"], (grown, shrunk)  # 2 ranks trained on
    assert_regrouped(sim, namespace, grown)
