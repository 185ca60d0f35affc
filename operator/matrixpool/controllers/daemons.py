"""What the operator tells the node checkpoint daemons, over one "tell, remember, retry" loop
(:class:`Teller`): their tier-1 peers and the KV-cache quotas of the services admitted to
their SuperNode's memory pool.

Each pass of the main loop (:mod:`matrixpool.controllers.loop`) plans (pure) what every daemon
should hold — ``(endpoint, when the daemon started, what it holds)`` by node — and a daemon is
told when that changed or the daemon started again (its Lease's ``acquireTime`` moved: a new
daemon knows nothing), in a task of its own (:mod:`matrixpool.controllers.background`). A
daemon that did not take it is asked again after the kind's retry period; a daemon gone, down
or silent is forgotten and told again when it is back. Losing the memory costs one round of
telling every daemon again.

**Tier-1 peers** (:func:`peer_plan`): DESIGN.md, "copied to ``peerReplicas`` daemons on other
nodes in another rack", so that one rack failing loses no committed step. The daemons of every
SuperNode — member nodes that are Ready and whose daemon announced itself
(:mod:`matrixpool.k8s.daemonleases`) and answers — are laid on the ring of
:func:`matrixpool_recovery.peers.assign_peers`, each with as many peers as the largest
``spec.checkpoint.memory.peerReplicas`` of the TrainingJobs there (at least one), and told
``POST /v1/peers``. Each save pushes ``peerReplicas`` copies, the first of the daemon's list; a
restoring trainer reads the peers from its node's daemon (``GET /v1/info``).

**KV-cache quotas** (:func:`kv_quota_plan`): the scheduling cycle decides admission
(:func:`matrixpool.serving.pool.admit`); every member node of a SuperNode with a memory pool
gets ``reserved // members`` bytes per admitted service, by service UID, and is told
(``GET /v1/kv/usage``, then ``DELETE /v1/kv/S`` and ``PUT /v1/kv/S/quota`` where they differ)
— so it forgets the services no longer admitted. A daemon started without
``--kv-pool-bytes`` refuses, and is asked again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import structlog

from matrixpool import clock, metrics
from matrixpool.api import labels, trainingjob
from matrixpool.controllers import background
from matrixpool.k8s import executor
from matrixpool.serving import pool
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool_recovery import peers as peer_policy
from matrixpool_recovery import policy

log = structlog.get_logger(__name__)

T = TypeVar("T")
Peers = tuple[str, ...]  # peer endpoints, in the order the daemon pushes copies
Quotas = tuple[tuple[str, int], ...]  # (service UID, bytes), sorted
PEERS_RETRY_SECONDS = 2.0  # a daemon that did not take its peers is asked again after this
QUOTAS_RETRY_SECONDS = 10.0  # ... its KV-cache quotas


@dataclass
class Teller(Generic[T]):
    """One kind of message to the daemons: what each was told (by node: endpoint, when that
    daemon started, the message), when telling one last failed, and the task telling them."""

    what: str  # for logs: "tier-1 peers", "KV-cache quotas"
    retry_seconds: float
    send: Callable[[executor.Executor, str, T], Awaitable[bool]]  # (act, endpoint, message)
    taken: Callable[[], None] = lambda: None  # called once per daemon that took its message
    told: dict[str, tuple[str, float, T]] = field(default_factory=dict)
    failed: dict[str, float] = field(default_factory=dict)  # node → monotonic time of failure
    tasks: background.Tasks = field(default_factory=background.Tasks)

    def run(self, wanted: Mapping[str, tuple[str, float, T]], act: executor.Executor) -> None:
        """Tell the daemons whose message changed (or that started again), in the background."""
        now = clock.SYSTEM.monotonic()
        changed = {
            n: t
            for n, t in wanted.items()
            if self.told.get(n) != t
            and now - self.failed.get(n, float("-inf")) >= self.retry_seconds
        }
        for node in set(self.told) - set(wanted):
            del self.told[node]  # gone, down or silent: told again when it is back
        if changed and not self.tasks.busy(self.what):
            self.tasks.start(self.what, self.tell(changed, act))

    async def tell(
        self, changed: Mapping[str, tuple[str, float, T]], act: executor.Executor
    ) -> None:
        nodes = sorted(changed)
        took = await asyncio.gather(*(self.send(act, changed[n][0], changed[n][2]) for n in nodes))
        refused = []
        for node, ok in zip(nodes, took, strict=True):
            if ok:
                self.told[node] = changed[node]
                self.failed.pop(node, None)
                self.taken()
            else:
                self.failed[node] = clock.SYSTEM.monotonic()
                refused.append(node)
        if refused:
            log.warning(
                f"daemons did not take their {self.what}; asking again",
                nodes=refused[:8],
                count=len(refused),
                retry_seconds=self.retry_seconds,
            )
        if len(refused) < len(nodes):
            log.info(f"told daemons their {self.what}", daemons=len(nodes) - len(refused))


async def _send_peers(act: executor.Executor, endpoint: str, peers: Peers) -> bool:
    return await act.set_peers(endpoint, list(peers))


async def _send_quotas(act: executor.Executor, endpoint: str, quotas: Quotas) -> bool:
    return await act.set_kv_quotas(endpoint, dict(quotas))


def _peers_teller() -> Teller[Peers]:
    return Teller("tier-1 peers", PEERS_RETRY_SECONDS, _send_peers, metrics.PEER_ASSIGNMENTS.inc)


def _quotas_teller() -> Teller[Quotas]:
    return Teller("KV-cache quotas", QUOTAS_RETRY_SECONDS, _send_quotas)


@dataclass
class Memory:
    """What the daemons were told, per kind. Owned by the main loop."""

    peers: Teller[Peers] = field(default_factory=_peers_teller)
    kv_quotas: Teller[Quotas] = field(default_factory=_quotas_teller)


def run(
    world: read_model.World,
    admitted: Mapping[str, pool.Decision],
    memory: Memory,
    act: executor.Executor,
    started: Mapping[str, float],
) -> None:
    """Tell the daemons their tier-1 peers and KV-cache quotas where they changed.
    ``admitted``: the scheduling cycle's last KV-cache admission, by service UID."""
    memory.peers.run(peer_plan(world, started), act)
    memory.kv_quotas.run(kv_quota_plan(world, admitted, started), act)


def _serving(world: read_model.World, name: str) -> list[tuple[str, str, dict[str, str]]]:
    """(node, daemon endpoint, labels) of the SuperNode ``name``'s members whose daemon can be
    told anything: Ready, announced, not silent."""
    silent = world.unreachable | world.stale
    return [
        (str(n.name), n.endpoint, dict(n.labels))
        for n in read_model.members(world).get(name, ())
        if n.endpoint and n.ready and n.name not in silent
    ]


def peer_plan(
    world: read_model.World, started: Mapping[str, float]
) -> dict[str, tuple[str, float, Peers]]:
    """Node → (its daemon, when that daemon started, the endpoints of its peers), for every
    daemon of every SuperNode (pure)."""
    wanted: dict[str, tuple[str, float, Peers]] = {}
    for name in sorted(world.supernodes):
        members = _serving(world, name)
        if not members:
            continue
        replicas = max([1, *(_peer_replicas(w, name) for w in world.workloads)])
        assignment = peer_policy.assign_peers(
            {policy.NodeName(n): (0,) for n, _, _ in members},
            {policy.NodeName(n): found.get(labels.RACK, n) for n, _, found in members},
            replicas,
        )
        endpoint = {n: e for n, e, _ in members}
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


def kv_quota_plan(
    world: read_model.World,
    admitted: Mapping[str, pool.Decision],
    started: Mapping[str, float],
) -> dict[str, tuple[str, float, Quotas]]:
    """Node → (its daemon, when that daemon started, the quotas it should hold), for every
    daemon of every SuperNode with a memory pool (pure)."""
    wanted: dict[str, tuple[str, float, Quotas]] = {}
    for name, sn in sorted(world.supernodes.items()):
        if sn.spec.memory_pool is None:
            continue
        quotas = tuple(
            sorted(
                (uid, d.quota_bytes)
                for uid, d in admitted.items()
                if isinstance(d, pool.Admitted) and d.super_node == name
            )
        )
        for node, endpoint, _ in _serving(world, name):
            wanted[node] = (endpoint, started.get(node, 0.0), quotas)
    return wanted
