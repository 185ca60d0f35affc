"""Read models (:class:`matrixpool.state.world.World`) built by hand, for the unit tests of
the controllers' plans: one SuperNode ``sn-a`` of nodes ``n0``… (8 cards each, a checkpoint
daemon on each), TrainingJobs in namespace ``ns`` and their pods as the index shows them."""

from __future__ import annotations

from typing import Any

from matrixpool.api import supernode, trainingjob
from matrixpool.k8s import convert
from matrixpool.placement import inventory
from matrixpool.state import world
from matrixpool.state.workloads import Workload
from matrixpool_recovery import manifest

CARDS = "huawei.com/Ascend910"
EIGHT = frozenset(range(8))


def pod(name: str, uid: str, **extra: Any) -> convert.PodFacts:
    """Pod ``name`` ("<job>-<rank>") as the index shows it: Pending and unbound, unless
    ``extra`` says otherwise."""
    fields: dict[str, Any] = {
        "namespace": "ns",
        "name": name,
        "owner": name.rsplit("-", 1)[0],
        "kind": "TrainingJob",
        "role": "trainer",
        "replica": 0,
        "rank": int(name.rsplit("-", 1)[1]),
        "node": None,
        "reserved_node": None,
        "cards": frozenset(),
        "phase": "Pending",
        "deleting": False,
        "ready": False,
        "uid": uid,
    }
    fields.update(extra)
    return convert.PodFacts(**fields)


def running(job: str, ranks: int, first_node: int = 0, **extra: Any) -> list[convert.PodFacts]:
    """The pods of a job bound one per node from ``n<first_node>`` on, Running."""
    return [
        pod(
            f"{job}-{r}",
            f"{job}-uid-{r}",
            node=f"n{first_node + r}",
            cards=EIGHT,
            phase="Running",
            **extra,
        )
        for r in range(ranks)
    ]


def index(*facts: convert.PodFacts) -> dict[str, list[convert.PodFacts]]:
    by_owner: dict[str, list[convert.PodFacts]] = {}
    for p in facts:
        by_owner.setdefault(f"ns/{p.owner}", []).append(p)
    return by_owner


def endpoint(node: str) -> str:
    return f"10.0.0.{node.removeprefix('n')}:7040"


def fixed_world(
    facts: dict[str, list[convert.PodFacts]],
    jobs: list[Workload],
    *,
    nodes: int = 4,
    spares: int = 0,
    down: frozenset[str] = frozenset(),
    time_sharing: dict[str, Any] | None = None,
    racks: bool = False,
) -> world.World:
    """``racks``: the SuperNode's topologyKeys name the rack label (racks of two nodes)."""
    spec: dict[str, Any] = {
        "nodeSelector": {"matchLabels": {"sn": "a"}},
        "cardResource": CARDS,
        "cardsPerNode": 8,
        "spares": {"nodes": spares},
    }
    if racks:
        spec["topologyKeys"] = ["matrixpool.dev/rack"]
    if time_sharing is not None:
        spec["timeSharing"] = time_sharing
    sn = supernode.parse(
        {
            "apiVersion": "matrixpool.dev/v1alpha1",
            "kind": "SuperNode",
            "metadata": {"name": "sn-a", "uid": "uid-sn-a"},
            "spec": spec,
        }
    )
    infos = [
        inventory.NodeInfo(
            inventory.NodeName(f"n{i}"),
            {"sn": "a", "matrixpool.dev/rack": f"rack-{i // 2}"},
            f"n{i}" not in down,
            {CARDS: 8},
            endpoint=endpoint(f"n{i}"),
            down=f"n{i}" in down,
        )
        for i in range(nodes)
    ]
    return world.World({"sn-a": sn}, infos, {}, facts, jobs)


def job(
    name: str,
    replicas: int,
    *,
    priority: int = 100,
    checkpoint: bool = False,
    status: dict[str, Any] | None = None,
    **spec_fields: Any,
) -> Workload:
    spec: dict[str, Any] = {
        "superNode": "sn-a",
        "replicas": replicas,
        "cardsPerReplica": 8,
        "priority": priority,
        **spec_fields,
    }
    if checkpoint:
        spec["checkpoint"] = {"memory": {"everySteps": 2}}
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": spec,
    }
    model = trainingjob.parse(body)
    return Workload("TrainingJob", "ns", name, f"uid-{name}", "", 1, model, None, status or {})


def held(job: str, step: int, rank: int, node: str, tier: str = "memory") -> manifest.Holding:
    """A shard of ``job`` (its UID) at ``step`` for ``rank``, held by ``node``'s daemon."""
    return manifest.Holding(job, rank, step, tier, 8, "crc32:0", node, node, 1)


def spare_swap_plan(restore: str, *, cards: str | None = None) -> dict[str, Any]:
    """``status.recovering`` of job ``a`` whose rank 1 moves from the lost n1 to the spare n2,
    every rank restoring ``restore`` (with ``cards``, its new pod is reserved on them)."""
    plan: dict[str, Any] = {
        "id": "r1-abc",
        "level": "SpareSwap",
        "cause": "NodeDown on n1",
        "restoredStep": 6,
        "lostSteps": 0,
        "detectedAt": "2026-11-30T10:00:00Z",
        "targets": {"1": "n2"},
        "restore": {"0-1": restore},
        "pinned": [],
    }
    if cards is not None:
        plan["cards"] = {"1": cards}
    return plan
