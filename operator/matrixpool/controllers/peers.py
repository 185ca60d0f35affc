"""Tier-1 peers: the operator tells every checkpoint daemon which daemons keep the in-memory
copies of its node's shards — in another rack (DESIGN.md: "copied to ``peerReplicas`` daemons
on other nodes in another rack", so that one rack failing loses no committed step).

Each pass of the main loop (:mod:`matrixpool.controllers.loop`) :func:`plan` (pure) lays the
daemons of every SuperNode — the member nodes that are Ready and whose daemon announced itself
(:mod:`matrixpool.k8s.daemonleases`) and answers — on the ring of
:func:`matrixpool_recovery.peers.assign_peers`, each with as many peers as the largest
``spec.checkpoint.memory.peerReplicas`` of the TrainingJobs there (at least one). A daemon is
told its list (``POST /v1/peers``, operator token) when the list changes or the daemon started
again (its Lease's ``acquireTime`` moved: a new daemon knows no peers), in a task of its own
(:mod:`matrixpool.controllers.background`). Each save pushes ``peerReplicas`` copies, the first
of the daemon's list; a restoring trainer reads the peers from its node's daemon
(``GET /v1/info``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from matrixpool import clock, metrics
from matrixpool.api import labels, trainingjob
from matrixpool.controllers import background
from matrixpool.k8s import executor
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool_recovery import peers as peer_policy
from matrixpool_recovery import policy

log = structlog.get_logger(__name__)

Told = tuple[str, float, tuple[str, ...]]  # (daemon endpoint, when it started, peer endpoints)
RETRY_SECONDS = 2.0  # a daemon that did not take its list is asked again after this


@dataclass
class Memory:
    """What each daemon was told (by node), when telling one last failed, and the task telling
    them. Owned by the main loop; losing it costs one round of telling every daemon again."""

    told: dict[str, Told] = field(default_factory=dict)
    failed: dict[str, float] = field(default_factory=dict)  # node → monotonic time of failure
    tasks: background.Tasks = field(default_factory=background.Tasks)


def plan(world: read_model.World, started: Mapping[str, float]) -> dict[str, Told]:
    """Node → (its daemon, when that daemon started, the endpoints of its peers), for every
    daemon of every SuperNode (pure)."""
    wanted: dict[str, Told] = {}
    silent = world.unreachable | world.stale
    by_supernode = read_model.members(world)
    for name in sorted(world.supernodes):
        members = [n for n in by_supernode[name] if n.endpoint and n.ready and n.name not in silent]
        if not members:
            continue
        replicas = max([1, *(_peer_replicas(w, name) for w in world.workloads)])
        assignment = peer_policy.assign_peers(
            {policy.NodeName(n.name): (0,) for n in members},
            {policy.NodeName(n.name): n.labels.get(labels.RACK, n.name) for n in members},
            replicas,
        )
        endpoint = {str(n.name): n.endpoint for n in members}
        for node, chosen in assignment.peers.items():
            wanted[node] = (
                endpoint[node],
                started.get(node, 0.0),
                tuple(endpoint[p] for p in chosen),
            )
    return wanted


def _peer_replicas(workload: Workload, supernode: str) -> int:
    if not isinstance(workload.model, trainingjob.TrainingJob):
        return 0
    spec = workload.model.spec
    if spec.super_node not in (None, "", supernode) or spec.checkpoint.memory is None:
        return 0
    return spec.checkpoint.memory.peer_replicas


def run(
    world: read_model.World,
    memory: Memory,
    act: executor.Executor,
    started: Mapping[str, float],
) -> None:
    """Tell the daemons whose peers changed (or that started again), in the background; a
    daemon that did not take its list is asked again after :data:`RETRY_SECONDS`."""
    now = clock.SYSTEM.monotonic()
    wanted = plan(world, started)
    changed = {
        n: t
        for n, t in wanted.items()
        if memory.told.get(n) != t and now - memory.failed.get(n, float("-inf")) >= RETRY_SECONDS
    }
    for node in set(memory.told) - set(wanted):
        del memory.told[node]  # gone, down or silent: told again when it is back
    if changed and not memory.tasks.busy("peers"):
        memory.tasks.start("peers", tell(changed, memory, act))


async def tell(changed: Mapping[str, Told], memory: Memory, act: executor.Executor) -> None:
    nodes = sorted(changed)
    took = await asyncio.gather(*(act.set_peers(changed[n][0], list(changed[n][2])) for n in nodes))
    refused = []
    for node, ok in zip(nodes, took, strict=True):
        if ok:
            memory.told[node] = changed[node]
            memory.failed.pop(node, None)
            metrics.PEER_ASSIGNMENTS.inc()
        else:
            memory.failed[node] = clock.SYSTEM.monotonic()
            refused.append(node)
    if refused:
        log.warning(
            "daemons did not take their tier-1 peers; asking again",
            nodes=refused[:8],
            count=len(refused),
            retry_seconds=RETRY_SECONDS,
        )
    if len(refused) < len(nodes):
        log.info("told daemons their tier-1 peers", daemons=len(nodes) - len(refused))
