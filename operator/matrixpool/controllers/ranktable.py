"""The HCCL rank table of every TrainingJob on Ascend cards: MindCluster's ``hccl.json``, from
the nodes and cards the operator chose, in a ConfigMap the job's pods mount read-only
(``RANK_TABLE_FILE``, :func:`matrixpool.k8s.pods._give_rendezvous`).

The table says ``"status": "initializing"`` until every rank the job runs with is bound with
its cards, then ``"completed"``, as MindCluster's does: a training script waits for
``completed`` before it reads the servers. It is written again whenever the placement changes
(a recovery moved a rank, the gang shrank or grew); the kubelet refreshes the file in every
running pod.

Shape (one entry per server, in rank order; a server's devices in card order)::

    {"version": "1.0", "status": "completed", "server_count": "2",
     "server_list": [{"server_id": "10.0.0.1",
                      "device": [{"device_id": "0", "rank_id": "0"}, ...]}, ...]}

``server_id`` is the node's InternalIP (its name when it reports none); ``rank_id`` is the
global device rank, ``rank * cardsPerReplica + i`` for the i-th card of a rank's pod.
MindCluster's ``device_ip`` (the card's RoCE address) is left out: no component of ours knows
the cards' network addresses.

Called by the main loop with the SuperNodes' status (after the bindings are written).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from matrixpool.api import labels, trainingjob
from matrixpool.k8s import executor
from matrixpool.placement import inventory
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload

log = structlog.get_logger(__name__)

ASCEND = "huawei.com/"  # card resources whose jobs get a rank table
VERSION = "1.0"


def wanted(card_resource: str) -> bool:
    """Whether a job on ``card_resource`` gets a rank table (Ascend cards)."""
    return card_resource.startswith(ASCEND)


@dataclass
class Memory:
    """The table last written per job UID (nothing is written while it is unchanged)."""

    written: dict[str, dict[str, Any]] = field(default_factory=dict)  # compared, not dumped

    def forget(self, uid: str, key: str) -> None:
        self.written.pop(uid, None)


def table(
    world: read_model.World,
    workload: Workload,
    nodes: Mapping[str, inventory.NodeInfo] | None = None,
) -> dict[str, Any] | None:
    """The job's rank table now, or None when it has none (not Ascend, or not placed at all).
    ``nodes``: the world's Nodes by name, when the caller has them (built once per pass: at
    64 supernodes, building it for each of 1,024 jobs took a third of the pass)."""
    model = workload.model
    if not isinstance(model, trainingjob.TrainingJob):
        return None
    size = read_model.replicas_now(world, workload)
    held = {
        p.rank: p
        for p in world.pods.get(workload.key, [])
        if not p.deleting and p.holds_cards and p.rank < size
    }
    if not held:
        return None
    if nodes is None:
        nodes = {n.name: n for n in world.nodes}
    if not any(wanted(_resource(nodes, p.node or p.reserved_node or "")) for p in held.values()):
        return None
    per_replica = model.spec.cards_per_replica
    servers: dict[str, list[dict[str, str]]] = {}
    for rank, pod in sorted(held.items()):
        node = nodes.get(pod.node or pod.reserved_node or "")
        server = (node.address or node.name) if node else (pod.node or pod.reserved_node or "")
        devices = servers.setdefault(server, [])
        for i, card in enumerate(sorted(pod.cards)):
            devices.append({"device_id": str(card), "rank_id": str(rank * per_replica + i)})
    # bound, not only reserved: a report may read the world while a binding cycle writes
    complete = set(held) == set(range(size)) and all(p.node for p in held.values())
    return {
        "version": VERSION,
        "status": "completed" if complete else "initializing",
        "server_count": str(len(servers)),
        "server_list": [{"server_id": s, "device": d} for s, d in servers.items()],
    }


def _resource(nodes: Mapping[str, inventory.NodeInfo], name: str) -> str:
    node = nodes.get(name)
    return next((r for r in node.cards if r.startswith(ASCEND)), "") if node else ""


async def run(world: read_model.World, memory: Memory, act: executor.Executor) -> None:
    """Write every changed rank table to its job's ConfigMap (owned by the job)."""
    nodes: dict[str, inventory.NodeInfo] = {n.name: n for n in world.nodes}
    for workload in world.workloads:
        found = table(world, workload, nodes)
        if found is None:
            continue
        if memory.written.get(workload.uid) == found:
            continue
        text = json.dumps(found, indent=2, sort_keys=True)
        name = labels.rank_table_config_map(workload.uid)
        try:
            await act.apply_configmap(
                workload.namespace, name, {labels.RANK_TABLE_KEY: text}, workload.ref
            )
        except Exception as error:  # the next pass tries again
            log.warning("could not write a rank table", job=workload.key, error=str(error))
            continue
        memory.written[workload.uid] = found
        log.info("wrote a rank table", job=workload.key, status=found["status"])
