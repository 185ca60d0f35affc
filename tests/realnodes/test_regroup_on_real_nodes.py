"""An elastic PyTorch job on real nodes shrinks and grows back (issue 32, items 1 and 3): the
example trainer (matrixpool.devcluster.torch_trainer: gloo, model and Adam through DCP on
matrixpool_recovery.torch) as 3 ranks of at least 2 on sn-real. A higher-priority job that
needs one node arrives: the elastic job is asked to checkpoint, answers, and shrinks — the
whole gang regroups at 2 ranks, each restoring the newest step all 3 committed. The
higher-priority job goes: it grows back, the 3 new ranks restoring what the 2 committed (rank 2
reads what the 2-rank world saved: DCP maps every item to the rank that saved it). Then a job of
a higher priority needs two nodes: a shrink cannot free them, so the gang is asked to
checkpoint, answers, and is evicted whole; when that job goes, its three ranks resume from the
newest step all three committed. Every rank of each new gang restores the same step and steps on,
and the job Succeeds with every rank's parameters bitwise those of a fault-free run of the same
world schedule (3 ranks to the first regroup's step, 2 to the second's, then 3), computed in
one process: an eviction and resume at the same size changes nothing of it."""

from __future__ import annotations

import json
from typing import Any

from tests.integration import framework
from tests.realnodes.conftest import (
    IMAGE,
    REAL_SUPERNODE,
    SPARE,
    EndedPods,
    Watched,
    ends_as,
    supernode,
)
from tests.realnodes.test_pytorch_on_real_nodes import job, reference

JOB = "torch-elastic"
STEPS = 140  # a step every 0.5 s: room for two regroups and an eviction
RANKS, FLOOR = 3, 2


def elastic() -> dict[str, Any]:
    """The example trainer's job, 3 ranks of at least 2, a step every 0.5 s."""
    body = job(JOB, ranks=RANKS, steps=STEPS, step_seconds=0.5)
    body["spec"]["minReplicas"], body["spec"]["priority"] = FLOOR, 10
    return body


def urgent(replicas: int = 1, name: str = "urgent") -> dict[str, Any]:
    """A job of a higher priority, a node per replica (one: sn-real's three usable nodes are the
    elastic job's)."""
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "superNode": REAL_SUPERNODE,
            "replicas": replicas,
            "cardsPerReplica": 8,
            "priority": 1000,
            "template": {
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "work",
                            "image": IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["python", "-c", "import time; time.sleep(900)"],
                        }
                    ],
                }
            },
        },
    }


def regrouped_to(watched: Watched, size: int, after: int = 0) -> dict[str, Any] | None:
    """The regroup to ``size`` ranks (the ``after``-th record on), once it finished."""
    records = (watched.status().get("resizes") or [])[after:]
    done = [r for r in records if r.get("finishedAt") and r["toReplicas"] == size]
    return done[-1] if done else None


def stepping_on(
    cluster: framework.TestCluster, namespace: str, resize: dict[str, Any]
) -> dict[int, tuple[int, int]] | None:
    """Rank → (step restored for ``resize``, newest step since), once every rank of the new
    world restored it and made two steps more."""
    return restored_and_stepping(cluster, namespace, f"resize-{resize['id']}", resize["toReplicas"])


def restored_and_stepping(
    cluster: framework.TestCluster, namespace: str, tag: str, size: int, job: str = JOB
) -> dict[int, tuple[int, int]] | None:
    """Rank → (step restored as ``tag`` says, newest step since), once each of ``size`` ranks
    of ``job`` restored it and made two steps more."""
    found = {}
    for rank, pod in Watched(cluster, namespace, job).rank_pods().items():
        logs = cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"], check=False)
        restored, newest = None, -1
        for text in logs.stdout.splitlines():
            line = json.loads(text) if text.startswith("{") else {}
            if line.get("recovery") == tag and line.get("restored") is not None:
                restored = int(line["restored"])
            elif restored is not None and "loss" in line:
                newest = max(newest, int(line["step"]))
        if restored is not None and newest >= restored + 2:
            found[rank] = (restored, newest)
    return found if sorted(found) == list(range(size)) else None


def eviction(watched: Watched) -> dict[str, Any] | None:
    """The preemption that evicted the whole gang (none kept), once it did."""
    evictions = [
        p
        for p in watched.status().get("preemptions") or []
        if p.get("replicasKept") is None and p.get("evictedAt")
    ]
    return evictions[-1] if evictions else None


def test_an_elastic_pytorch_job_shrinks_and_grows_back_to_the_parameters_of_the_same_schedule(
    installed: framework.TestCluster, namespace: str
) -> None:
    cluster = installed
    watched = Watched(cluster, namespace, JOB)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(supernode()))
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(elastic()))
    with EndedPods(cluster, namespace):
        watched.training(past=6)
        assert len(watched.rank_pods()) == RANKS

        # 1. A higher priority needs a node: a checkpoint is asked and answered, then the gang
        #    regroups at 2 ranks (new pods: a running torch process keeps its WORLD_SIZE).
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(urgent()))
        shrunk = framework.eventually(
            lambda: regrouped_to(watched, FLOOR), timeout=240, interval=1, what="shrunk to 2"
        )
        print("shrink:", shrunk)
        assert (shrunk["fromReplicas"], shrunk["reason"]) == (RANKS, "Preemption"), shrunk
        (preempted,) = watched.status()["preemptions"]
        assert (preempted["replicasKept"], preempted["checkpoint"]) == (FLOOR, "Answered")
        assert shrunk["restoredStep"] >= preempted["step"], (shrunk, preempted)
        ranks = framework.eventually(
            lambda: stepping_on(cluster, namespace, shrunk),
            timeout=180,
            interval=2,
            what="both ranks of the new world restore and step on",
        )
        assert {step for step, _ in ranks.values()} == {shrunk["restoredStep"]}, ranks
        for pod in watched.rank_pods().values():
            env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
            assert env["WORLD_SIZE"] == env["MATRIXPOOL_WORLD_SIZE"] == str(FLOOR), env

        # 2. It goes: the job grows back, all three restoring what the two committed.
        cluster.kubectl("delete", "trainingjob", "urgent", "-n", namespace, "--wait=false")
        grown = framework.eventually(
            lambda: regrouped_to(watched, RANKS), timeout=240, interval=1, what="grown to 3"
        )
        print("grow:", grown)
        assert (grown["fromReplicas"], grown["reason"]) == (FLOOR, "Replicas"), grown
        assert grown["restoredStep"] > shrunk["restoredStep"], (grown, shrunk)
        ranks = framework.eventually(
            lambda: stepping_on(cluster, namespace, grown),
            timeout=180,
            interval=2,
            what="the three ranks of the new world restore and step on",
        )
        assert {step for step, _ in ranks.values()} == {grown["restoredStep"]}, ranks

        # 3. A higher priority needs two nodes: shrinking to 2 frees one, so the whole gang is
        #    evicted (asked to checkpoint first, which it answers); once that job goes, the
        #    three ranks resume from the newest step all of them committed.
        cluster.kubectl(
            "apply", "-n", namespace, "-f", "-", input=json.dumps(urgent(2, "urgent-pair"))
        )
        evicted = framework.eventually(
            lambda: eviction(watched), timeout=240, interval=1, what="evicted whole"
        )
        print("eviction:", evicted)
        assert evicted["checkpoint"] == "Answered", evicted
        assert evicted["step"] >= grown["restoredStep"], (evicted, grown)
        framework.eventually(
            lambda: not watched.rank_pods(), timeout=120, interval=1, what="no rank left"
        )
        cluster.kubectl("delete", "trainingjob", "urgent-pair", "-n", namespace, "--wait=false")
        resumed = framework.eventually(
            lambda: (eviction(watched) or {}).get("resumedAt") and eviction(watched),
            timeout=240,
            interval=1,
            what="resumed",
        )
        # At least the step committed when it answered: its ranks saved on until they stopped.
        assert resumed["restoredStep"] >= evicted["step"], resumed
        ranks = framework.eventually(
            lambda: restored_and_stepping(
                cluster, namespace, f"preempt-{resumed['requestId']}", RANKS
            ),
            timeout=180,
            interval=2,
            what="the three ranks restore the same step and step on",
        )
        assert {step for step, _ in ranks.values()} == {resumed["restoredStep"]}, ranks
        assert len(watched.status()["resizes"]) == 2  # an eviction is no regroup

        # 4. To the end, with the fault-free parameters of the same world schedule.
        schedule = [(shrunk["restoredStep"], FLOOR), (grown["restoredStep"], RANKS)]
        made = reference(
            namespace, SPARE, steps=STEPS, ranks=RANKS, regroups=schedule, name="elastic-reference"
        )
        cluster.kubectl("apply", "-f", "-", input=json.dumps(made))
        watched.succeeded()
    ends_as(cluster, namespace, watched, "elastic-reference", RANKS, STEPS)
