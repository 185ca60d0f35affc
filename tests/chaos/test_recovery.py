"""Chaos tests of the recovery ladder (issue 5) on the real control plane, with ``matrixpool
sim`` playing kubelets and trainers: break a node, a card, a process, the operator, the API
server, every daemon of a supernode — and check that the job runs again from the newest
committed step that survived, with the bytes it saved, no card ever held twice, and the right
entry in status.recoveries."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.chaos.conftest import CardSampler
from tests.integration import chart, framework, manifests

MEMORY_EVERY = 2  # tier-1 checkpoint every 2 steps (a step is 0.2 s in the sim)
JOB = "llm"


# ---- helpers -------------------------------------------------------------------------------


def persistent_uri(tmp_path: Path) -> str:
    """The test's tier-3 URI, inside the chart's persistentPath (shared by every node)."""
    return f"file://{chart.SHARED}/{tmp_path.name}"


def persistent_dir(sim: framework.Sim, tmp_path: Path) -> Path:
    """The test's tier-3 folder as this machine holds it (the sim's shared path)."""
    return sim.folder / "shared" / chart.SHARED.strip("/") / tmp_path.name


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
    minimum: int | None = None,
) -> None:
    job = manifests.training_job(JOB).replicas(replicas, minimum).cards(8)
    if supernode:
        job = job.on(supernode)
    job.body["spec"]["checkpoint"] = {
        "memory": {"everySteps": MEMORY_EVERY, "peerReplicas": 1},
        "local": {"everySteps": 5},
        "persistent": {"everySteps": persistent_every, "uri": persistent_uri(tmp_path)},
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


def restored_lines(
    sim: framework.Sim, namespace: str, rank: int, recovery: str
) -> list[dict[str, Any]]:
    return [
        line
        for line in sim.trainer_lines(namespace, f"{JOB}-{rank}")
        if line.get("recovery") == recovery and "restored" in line
    ]


def assert_restored(
    sim: framework.Sim,
    namespace: str,
    entry: dict[str, Any],
    ranks: int,
    committed_before: int,
) -> dict[int, dict[str, Any]]:
    """Every rank reloaded the entry's step, intact; that step is no older than the newest
    one committed before the fault. Returns each rank's restore line."""
    step = entry["restoredStep"]
    assert step >= committed_before, f"restored {step}, but {committed_before} was committed"
    found = {}
    for rank in range(ranks):
        lines = framework.eventually(
            lambda rank=rank: restored_lines(sim, namespace, rank, entry["id"]),
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


# ---- 1. node down under a rank --------------------------------------------------------------


def test_node_down_under_a_rank_swaps_it_to_a_spare_from_the_peer_copy(
    cluster: framework.TestCluster,
    operator: chart.Installed,
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
    lines = assert_restored(sim, namespace, entry, 4, committed)
    assert lines[1]["source"].startswith("peer"), str(lines[1])  # the dead node's memory is gone
    assert before["replicas"]["desired"] == 4
    reasons = cluster.kubectl(
        "get", "events", "-n", namespace, "-o", "jsonpath={.items[*].reason}"
    ).stdout.split()
    assert {"Recovering", "Recovered"} <= set(reasons), reasons  # kubectl describe tells it
    wait_training(cluster, namespace, past=entry["restoredStep"] + 2)


# ---- 2. two nodes of one rack at once -------------------------------------------------------


def rack_mates(cluster: framework.TestCluster, placed: dict[int, str]) -> tuple[str, str]:
    """Two nodes of the gang in one rack."""
    racks: dict[str, list[str]] = {}
    for node in sorted(set(placed.values())):
        labels = cluster.api.core.read_node(node).metadata.labels
        racks.setdefault(labels["matrixpool.dev/rack"], []).append(node)
    pair = next(nodes for nodes in racks.values() if len(nodes) >= 2)
    return pair[0], pair[1]


def test_two_nodes_lost_at_once_swap_to_two_spares_and_three_reschedule(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    # Two spares: both failed nodes swap, in one recovery.
    cluster.kubectl("apply", "-f", "-", input=manifests.supernode("sn-0", spares=2).yaml())
    start_job(cluster, namespace, tmp_path, replicas=8)
    wait_training(cluster, namespace, past=6)
    placed = node_of(cluster, namespace)
    down = rack_mates(cluster, placed)
    committed = status(cluster, namespace)["checkpoints"]["memory"]
    cluster.matrixpool("cluster", "fault", "node-down", *down)
    try:
        entry = wait_recovered(cluster, namespace, 1)
    finally:
        cluster.matrixpool("cluster", "fault", "node-up", *down)
    assert entry["level"] == "SpareSwap", entry
    assert sorted(entry["moves"]) == sorted(down)
    assert len(set(entry["moves"].values())) == 2  # one spare per failed node
    assert entry["ranks"] == sorted(r for r, n in placed.items() if n in down)
    assert_restored(sim, namespace, entry, 8, committed)

    # Three nodes at once with two spares (issue 32): the spares run out, so the whole gang is
    # placed again, as the policy says (never a swap of two and the third rank left behind).
    wait_training(cluster, namespace, past=entry["restoredStep"] + 4)
    placed = node_of(cluster, namespace)
    pair = rack_mates(cluster, placed)
    third = next(n for n in sorted(set(placed.values())) if n not in pair)
    down = (*pair, third)
    committed = status(cluster, namespace)["checkpoints"]["memory"]
    cluster.matrixpool("cluster", "fault", "node-down", *down)
    try:
        entry = wait_recovered(cluster, namespace, 2)
    finally:
        cluster.matrixpool("cluster", "fault", "node-up", *down)
    assert entry["level"] == "Reschedule", entry
    assert all(node in entry["cause"] for node in down), entry  # one recovery for the three
    assert entry["ranks"] == list(range(8))
    assert not set(node_of(cluster, namespace).values()) & set(down)
    assert_restored(sim, namespace, entry, 8, committed)


# ---- 3. one card unhealthy ---------------------------------------------------------------------


def test_one_unhealthy_card_moves_only_the_rank_that_holds_it(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path)
    wait_training(cluster, namespace, past=6)
    placed = node_of(cluster, namespace)
    sick = placed[2]
    committed = status(cluster, namespace)["checkpoints"]["memory"]
    cluster.matrixpool("cluster", "fault", "cards", sick, "3")
    try:
        entry = wait_recovered(cluster, namespace, 1)
    finally:
        cluster.matrixpool("cluster", "fault", "cards", sick, "")
    assert entry["level"] == "SpareSwap", entry
    assert entry["cause"] == f"CardsUnhealthy on {sick} cards [3]", entry
    assert entry["ranks"] == [2]
    now = node_of(cluster, namespace)
    assert now[2] == entry["moves"][sick]
    assert {r: n for r, n in now.items() if r != 2} == {r: n for r, n in placed.items() if r != 2}
    assert_restored(sim, namespace, entry, 4, committed)


# ---- 4. a trainer process crashes on a healthy node -------------------------------------------


def test_a_crashed_trainer_restarts_in_place_from_its_nodes_memory(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path)
    wait_training(cluster, namespace, past=6)
    placed = node_of(cluster, namespace)
    committed = status(cluster, namespace)["checkpoints"]["memory"]
    pid_file = sim.folder / "trainers" / f"{placed[3]}.{namespace}.{JOB}-3.pid"
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    entry = wait_recovered(cluster, namespace, 1)
    assert entry["level"] == "InPlace", entry
    assert entry["cause"] == f"PodFailed on {placed[3]}", entry
    assert entry["ranks"] == [3]
    assert node_of(cluster, namespace) == placed  # nobody moved
    lines = assert_restored(sim, namespace, entry, 4, committed)
    # From its own node's daemon: memory, or its disk when that holds a newer common step.
    assert lines[3]["source"] in (f"memory:{placed[3]}", f"local:{placed[3]}"), lines[3]
    assert entry["lostSteps"] <= MEMORY_EVERY, entry


# ---- 5. the operator killed in the middle of a recovery --------------------------------------


def test_a_recovery_cut_short_by_an_operator_kill_is_finished_once_by_the_next(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    # The chart's operator, told to stop for 60 s after it writes a recovery plan.
    operator.set_operator_env({"MATRIXPOOL_RECOVERY_PAUSE_SECONDS": "60"})
    start_job(cluster, namespace, tmp_path)
    wait_training(cluster, namespace, past=6)
    victim = node_of(cluster, namespace)[0]
    committed = status(cluster, namespace)["checkpoints"]["memory"]
    cluster.matrixpool("cluster", "fault", "node-down", victim)
    try:
        plan = framework.eventually(
            lambda: status(cluster, namespace).get("recovering"),
            timeout=30,
            what="the recovery plan in status",
        )
        # helm upgrade without the pause: the Deployment replaces the pod, its kubelet kills
        # the paused operator (SIGKILL, the plan written and no pod touched), the next one runs.
        old = operator.operator_uid()
        operator.extra_env = {}
        cluster.helm(
            "upgrade", chart.RELEASE, str(chart.CHART), "-n", chart.SYSTEM, *operator.helm_args()
        )
        framework.eventually(
            lambda: operator.operator_uid() not in (None, old),
            timeout=60,
            what="the paused operator's pod replaced",
        )
        assert status(cluster, namespace).get("recoveries") in (None, [])
        entry = wait_recovered(cluster, namespace, 1)
    finally:
        cluster.matrixpool("cluster", "fault", "node-up", victim)
    assert entry["id"] == plan["id"]
    assert entry["level"] == plan["level"] == "SpareSwap"
    assert_restored(sim, namespace, entry, 4, committed)
    time.sleep(3)  # a second operator loop must not append it again
    assert [e["id"] for e in status(cluster, namespace)["recoveries"]] == [plan["id"]]


# ---- 6. kube-apiserver restarted during steady training ------------------------------------


def test_an_api_server_restart_causes_no_recovery_and_loses_nothing(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path)
    before = wait_training(cluster, namespace, past=6)["checkpoints"]["memory"]
    placed = node_of(cluster, namespace)
    cluster.local.restart("kube-apiserver")
    after = wait_training(cluster, namespace, past=before + 20, timeout=120)
    current = status(cluster, namespace)
    assert not current.get("recoveries"), current["recoveries"]
    assert after["checkpoints"]["memory"] > before
    assert node_of(cluster, namespace) == placed
    for rank in range(4):  # one trainer per rank, never restored: it just went on
        restores = [
            line for line in sim.trainer_lines(namespace, f"{JOB}-{rank}") if "restored" in line
        ]
        assert len(restores) == 1, f"rank {rank} restarted: {restores}"
        assert restores[0]["restored"] is None


# ---- 7. every daemon of a supernode killed ----------------------------------------------------


def test_every_daemon_of_a_supernode_killed_reschedules_onto_another_from_tier_3(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path, supernode=None, persistent_every=4)
    before = framework.eventually(
        lambda: (
            (s := wait_training(cluster, namespace, past=6))["checkpoints"].get("persistent") and s
        ),
        timeout=60,
        what="a persistent checkpoint",
    )
    first = before["placement"]["superNode"]
    members = [
        n.metadata.name
        for n in cluster.api.core.list_node(
            label_selector=f"matrixpool.dev/supernode={first}"
        ).items
    ]
    persisted = status(cluster, namespace)["checkpoints"]["persistent"]
    cluster.matrixpool("cluster", "fault", "daemon-down", *members)
    try:
        entry = wait_recovered(cluster, namespace, 1, timeout=120)
        after = status(cluster, namespace)
    finally:
        cluster.matrixpool("cluster", "fault", "daemon-up", *members)
    assert entry["level"] == "Reschedule", entry
    assert entry["cause"].startswith("DaemonUnreachable"), entry
    assert after["placement"]["superNode"] != first
    lines = assert_restored(sim, namespace, entry, 4, persisted)
    assert {line["source"] for line in lines.values()} == {"persistent"}


# ---- maxRecoveries -----------------------------------------------------------------------------


def test_a_fault_past_max_recoveries_fails_the_job_with_the_reason_and_frees_its_cards(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path, max_recoveries=1)
    wait_training(cluster, namespace, past=6)

    def crash(rank: int) -> None:
        pod = pods(cluster, namespace)[rank]
        pid = sim.folder / "trainers" / f"{pod.spec.node_name}.{namespace}.{JOB}-{rank}.pid"
        os.kill(int(pid.read_text()), signal.SIGKILL)

    crash(0)
    assert wait_recovered(cluster, namespace, 1)["level"] == "InPlace"
    wait_training(cluster, namespace, past=status(cluster, namespace)["checkpoints"]["memory"])
    crash(1)

    def failed() -> dict[str, Any] | None:
        current = status(cluster, namespace)
        return current if current.get("phase") == "Failed" else None

    final = framework.eventually(failed, timeout=60, what="the job Failed")
    [condition] = [c for c in final["conditions"] if c["type"] == "Failed"]
    assert condition["status"] == "True"
    assert condition["reason"] == "MaxRecoveriesReached"
    assert "maxRecoveries (1)" in condition["message"]
    assert len(final["recoveries"]) == 1  # the second fault was not recovered
    framework.eventually(
        lambda: not pods(cluster, namespace), timeout=60, what="the failed job's pods gone"
    )
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "reason=MaxRecoveriesReached"
    ).stdout
    assert JOB in events
