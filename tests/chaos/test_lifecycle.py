"""The end of a TrainingJob's life and its restart from step 0 (issue 13, "Lifecycle") on the
real control plane, with ``matrixpool sim`` as kubelets and trainers: a trainer whose pod sets
``MATRIXPOOL_SIM_STEPS`` exits 0 after that step and the sim reports its pod Succeeded.

(a) a job run to completion is Succeeded, holds no card while its pods are kept, another job
    runs on the SuperNode, and its pods go ``ttlSecondsAfterFinished`` later;
(b) a job that has no checkpoint yet and loses a rank restarts from step 0, recorded as such,
    and trains on.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from tests.chaos.conftest import CardSampler
from tests.integration import chart, framework, manifests

STEPS = 15  # the finishing job's last step (0.2 s a step in the sim)
TTL = 20  # its pods' ttlSecondsAfterFinished


def status(cluster: framework.TestCluster, namespace: str, job: str) -> dict[str, Any]:
    body = cluster.api.custom.get_namespaced_custom_object(
        "matrixpool.dev", "v1alpha1", namespace, "trainingjobs", job
    )
    return dict(body.get("status") or {})


def pods_of(cluster: framework.TestCluster, namespace: str, job: str) -> list[Any]:
    return list(
        cluster.api.core.list_namespaced_pod(
            namespace, label_selector=f"matrixpool.dev/job={job}"
        ).items
    )


def allocated(cluster: framework.TestCluster, supernode: str) -> int | None:
    body = cluster.api.custom.get_cluster_custom_object(
        "matrixpool.dev", "v1alpha1", "supernodes", supernode
    )
    return ((body.get("status") or {}).get("cards") or {}).get("allocated")


def apply(cluster: framework.TestCluster, namespace: str, job: manifests.Manifest) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())


def with_env(job: manifests.TrainingJobManifest, **env: str) -> manifests.TrainingJobManifest:
    (container,) = job.body["spec"]["template"]["spec"]["containers"]
    container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return job


def phase_is(cluster: framework.TestCluster, namespace: str, job: str, phase: str) -> Any:
    def probe() -> dict[str, Any] | None:
        current = status(cluster, namespace, job)
        return current if current.get("phase") == phase else None

    return probe


# ---- (a) run to completion ------------------------------------------------------------------


def test_a_job_run_to_completion_succeeds_frees_its_cards_and_its_pods_go_after_the_ttl(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
) -> None:
    done = with_env(
        manifests.training_job("done").replicas(2).cards(8).on("sn-0"),
        **{"MATRIXPOOL_SIM_STEPS": str(STEPS)},
    )
    done.body["spec"]["ttlSecondsAfterFinished"] = TTL
    apply(cluster, namespace, done)
    final = framework.eventually(
        phase_is(cluster, namespace, "done", "Succeeded"), timeout=90, what="done Succeeded"
    )
    finished_at = time.monotonic()
    assert final["completionTime"]
    (complete,) = [c for c in final["conditions"] if c["type"] == "Complete"]
    assert (complete["status"], complete["reason"]) == ("True", "AllRanksSucceeded")
    assert final["replicas"]["bound"] == 0
    assert not final.get("recoveries"), "finishing is no fault"
    kept = pods_of(cluster, namespace, "done")
    assert sorted(p.status.phase for p in kept) == ["Succeeded", "Succeeded"], "kept for logs"
    for rank in (0, 1):
        lines = sim.trainer_lines(namespace, f"done-{rank}")
        assert any(line.get("finished") and line.get("step") == STEPS for line in lines), lines[-3:]
    framework.eventually(
        lambda: allocated(cluster, "sn-0") == 0, timeout=30, what="sn-0 holds no card"
    )

    # Its cards are free for another job while its pods are still there.
    apply(cluster, namespace, manifests.training_job("next").replicas(2).cards(8).on("sn-0"))
    framework.eventually(
        phase_is(cluster, namespace, "next", "Running"), timeout=60, what="next Running"
    )
    assert time.monotonic() - finished_at < TTL, "next ran before the ttl took done's pods"
    assert len(pods_of(cluster, namespace, "done")) == 2
    assert status(cluster, namespace, "done")["phase"] == "Succeeded", "it never goes back"

    # The ttl takes the pods, not the job.
    framework.eventually(
        lambda: not pods_of(cluster, namespace, "done"), timeout=TTL + 30, what="done's pods gone"
    )
    assert time.monotonic() - finished_at >= TTL - 2, "the pods went before their ttl"
    assert status(cluster, namespace, "done")["phase"] == "Succeeded"
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "reason=Succeeded"
    ).stdout
    assert "done" in events


# ---- (b) no checkpoint yet: restart from step 0 -----------------------------------------------


def test_a_job_with_no_checkpoint_yet_that_loses_a_rank_restarts_from_step_0(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
) -> None:
    job = manifests.training_job("fresh").replicas(2).cards(8).on("sn-0")
    job.body["spec"]["checkpoint"] = {"memory": {"everySteps": 1_000_000}}  # never reached
    apply(cluster, namespace, job)
    framework.eventually(
        phase_is(cluster, namespace, "fresh", "Running"), timeout=60, what="fresh Running"
    )

    def stepped(rank: int, past: int) -> bool:
        lines = sim.trainer_lines(namespace, f"fresh-{rank}")
        return any(line.get("step", 0) > past for line in lines if "restored" not in line)

    framework.eventually(lambda: stepped(1, 5), timeout=60, what="rank 1 past step 5")
    (victim,) = [p for p in pods_of(cluster, namespace, "fresh") if p.metadata.name.endswith("-1")]
    node = victim.spec.node_name
    pid = sim.folder / "trainers" / f"{node}.{namespace}.fresh-1.pid"
    os.kill(int(pid.read_text()), signal.SIGKILL)

    def recovered() -> dict[str, Any] | None:
        current = status(cluster, namespace, "fresh")
        entries = current.get("recoveries") or []
        running = current.get("phase") == "Running" and not current.get("recovering")
        return entries[0] if entries and running else None

    entry = framework.eventually(recovered, timeout=90, what="fresh recovered")
    assert entry["level"] == "InPlace", entry
    assert entry["cause"] == f"PodFailed on {node}", entry
    assert entry["fromScratch"] is True, entry
    assert "restoredStep" not in entry, entry
    assert status(cluster, namespace, "fresh")["phase"] != "Failed"
    for rank in (0, 1):  # every rank started over from step 0 as the recovery said
        lines = framework.eventually(
            lambda rank=rank: [
                line
                for line in sim.trainer_lines(namespace, f"fresh-{rank}")
                if line.get("recovery") == entry["id"] and line.get("fresh")
            ],
            timeout=30,
            what=f"rank {rank} restarts fresh for {entry['id']}",
        )
        assert (lines[-1]["step"], lines[-1]["restored"]) == (0, None), lines[-1]

    def trains_on() -> bool:  # past step 3 of the new run, on both ranks
        for rank in (0, 1):
            lines = sim.trainer_lines(namespace, f"fresh-{rank}")
            starts = [i for i, line in enumerate(lines) if line.get("recovery") == entry["id"]]
            if not starts or not any(line.get("step", 0) > 3 for line in lines[starts[-1] :]):
                return False
        return True

    framework.eventually(trains_on, timeout=60, what="both ranks train on after the restart")
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "reason=Recovered"
    ).stdout
    assert "no checkpoint yet" in events
