"""Chaos tests of the recovery ladder (issue 5) on the real control plane, with ``matrixpool
sim`` playing kubelets and trainers: break a node, a card, a process, the operator, the API
server, every daemon of a supernode — and check that the job runs again from the newest
committed step that survived, with the bytes it saved, no card ever held twice, and the right
entry in status.recoveries."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.chaos.conftest import CardSampler
from tests.integration import framework, manifests

MEMORY_EVERY = 2  # tier-1 checkpoint every 2 steps (a step is 0.2 s in the sim)
JOB = "llm"


# ---- helpers -------------------------------------------------------------------------------


def start_job(
    cluster: framework.TestCluster,
    namespace: str,
    tmp_path: Path,
    *,
    replicas: int = 4,
    supernode: str | None = "sn-0",
    levels: list[str] | None = None,
    persistent_every: int = 10,
    max_recoveries: int = 10,
) -> None:
    job = manifests.training_job(JOB).replicas(replicas).cards(8)
    if supernode:
        job = job.on(supernode)
    job.body["spec"]["checkpoint"] = {
        "memory": {"everySteps": MEMORY_EVERY, "peerReplicas": 1},
        "local": {"everySteps": 5},
        "persistent": {"everySteps": persistent_every, "uri": f"file://{tmp_path / 'ckpt'}"},
    }
    job.body["spec"]["recovery"] = {
        "maxRecoveries": max_recoveries,
        "levels": levels or ["InPlace", "SpareSwap", "Reschedule"],
    }
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=job.yaml())


def status(cluster: framework.TestCluster, namespace: str) -> dict[str, Any]:
    body = cluster.api.custom.get_namespaced_custom_object(
        "matrixpool.dev", "v1alpha1", namespace, "trainingjobs", JOB
    )
    return dict(body.get("status") or {})


def pods(cluster: framework.TestCluster, namespace: str) -> dict[int, Any]:
    """Rank → its live pod."""
    items = cluster.api.core.list_namespaced_pod(
        namespace, label_selector="matrixpool.dev/job"
    ).items
    return {
        int(p.metadata.labels["matrixpool.dev/rank"]): p
        for p in items
        if not p.metadata.deletion_timestamp
    }


def wait_training(
    cluster: framework.TestCluster, namespace: str, *, past: int = 0, timeout: float = 90
) -> dict[str, Any]:
    """Until the job is Running with a memory checkpoint newer than ``past``; its status."""

    def probe() -> dict[str, Any] | None:
        current = status(cluster, namespace)
        step = (current.get("checkpoints") or {}).get("memory")
        running = current.get("phase") == "Running" and not current.get("recovering")
        return current if running and isinstance(step, int) and step > past else None

    return framework.eventually(probe, timeout=timeout, what=f"{JOB} running past step {past}")


def wait_recovered(
    cluster: framework.TestCluster, namespace: str, count: int, timeout: float = 90
) -> dict[str, Any]:
    """Until status.recoveries has ``count`` entries and the job runs; the newest entry."""

    def probe() -> dict[str, Any] | None:
        current = status(cluster, namespace)
        entries = current.get("recoveries") or []
        done = len(entries) >= count and current.get("phase") == "Running"
        return entries[count - 1] if done and not current.get("recovering") else None

    return framework.eventually(probe, timeout=timeout, what=f"recovery {count} of {JOB}")


def restored_lines(sim: framework.Sim, rank: int, recovery: str) -> list[dict[str, Any]]:
    return [
        line
        for line in sim.trainer_lines(f"{JOB}-{rank}")
        if line.get("recovery") == recovery and "restored" in line
    ]


def assert_restored(
    sim: framework.Sim, entry: dict[str, Any], ranks: int, committed_before: int
) -> dict[int, dict[str, Any]]:
    """Every rank reloaded the entry's step, intact; that step is no older than the newest
    one committed before the fault. Returns each rank's restore line."""
    step = entry["restoredStep"]
    assert step >= committed_before, f"restored {step}, but {committed_before} was committed"
    found = {}
    for rank in range(ranks):
        lines = framework.eventually(
            lambda rank=rank: restored_lines(sim, rank, entry["id"]),
            timeout=30,
            what=f"rank {rank} restores for {entry['id']}",
        )
        line = lines[-1]
        assert line["restored"] == step, f"rank {rank} restored {line} instead of step {step}"
        assert line["intact"] is True, f"rank {rank}'s restored bytes differ from the saved ones"
        found[rank] = line
    return found


def node_of(cluster: framework.TestCluster, namespace: str) -> dict[int, str]:
    return {rank: pod.spec.node_name for rank, pod in pods(cluster, namespace).items()}


def timed(action: Callable[[], object]) -> float:
    started = time.monotonic()
    action()
    return time.monotonic() - started


# ---- 1. node down under a rank --------------------------------------------------------------


def test_node_down_under_a_rank_swaps_it_to_a_spare_from_the_peer_copy(
    cluster: framework.TestCluster,
    operator: framework.Operator,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path)
    before = wait_training(cluster, namespace, past=6)
    placed = node_of(cluster, namespace)
    victim = placed[1]
    committed = status(cluster, namespace)["checkpoints"]["memory"]
    cluster.matrixpool("cluster", "fault", "node-down", victim)
    try:
        entry = wait_recovered(cluster, namespace, 1)
    finally:
        cluster.matrixpool("cluster", "fault", "node-up", victim)
    assert entry["level"] == "SpareSwap", entry
    assert entry["cause"].startswith("NodeDown on " + victim), entry
    assert entry["ranks"] == [1]
    spare = entry["moves"][victim]
    now = node_of(cluster, namespace)
    assert now[1] == spare
    assert spare not in placed.values()
    assert {r: n for r, n in now.items() if r != 1} == {r: n for r, n in placed.items() if r != 1}
    assert entry["lostSteps"] is not None, entry
    assert entry["lostSteps"] <= MEMORY_EVERY, entry
    lines = assert_restored(sim, entry, 4, committed)
    assert lines[1]["source"].startswith("peer"), str(lines[1])  # the dead node's memory is gone
    assert before["replicas"]["desired"] == 4
    wait_training(cluster, namespace, past=entry["restoredStep"] + 2)
