"""Checkpoint-aware priority preemption (issue 12) on the real control plane, with
``matrixpool sim`` playing kubelets and trainers: a training job that a higher priority
preempts is asked to checkpoint first, gives up its cards once it answered, says so in its
Preempted condition and its ``status.preemptions`` record, and later resumes from the step
it saved, or a newer one its trainers committed before they stopped (the record then says
when, and which step)."""

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
