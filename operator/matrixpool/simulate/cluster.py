"""The simulated pool as the placement engine sees it: one incremental snapshot of every card,
plus the spare nodes and the cards out of service, kept as holdings of the snapshot.

Called by :mod:`.run`. Gangs are placed by :func:`matrixpool.placement.engine.place` and
committed to the snapshot, never written around it, so a card can never be held twice (the
snapshot's commit raises ``StaleSnapshotError`` on a card that is not free).

The operator rebuilds its snapshot every cycle and takes spares from the layout; a run of
weeks cannot rebuild 20,736 nodes at every fault, so here the topology has no layout spares
and a spare or a broken card is a holding of a reserved gang (``spare/<supernode>``,
``down/<node>``): the engine skips held cards exactly as it skips spares and unhealthy ones.
Spares are chosen by the operator's own rule (:func:`inventory.choose_spares`: idle, fully
healthy, last in name order) and refilled the same way when SpareSwap takes one.
"""

from __future__ import annotations

from collections.abc import Iterable

from matrixpool.placement import engine, inventory, model
from matrixpool.placement.inventory import NodeName
from matrixpool.simulate import model as sim

CARD = "huawei.com/Ascend910"
SPARE = "spare/"  # gang key prefix of a supernode's spares
DOWN = "down/"  # gang key prefix of a node's cards out of service


class Pool:
    """The snapshot, who holds each node, and the free spares per supernode."""

    def __init__(self, cluster: sim.Cluster, spares: bool) -> None:
        self.cluster = cluster
        self.topologies = [self._supernode(s) for s in range(cluster.supernodes)]
        self.snapshot = engine.Snapshot.build(self.topologies, [])
        self.names = [slot.name for t in self.topologies for slot in t.nodes]  # global index
        self.rack_of = {slot.name: slot.domains[0] for t in self.topologies for slot in t.nodes}
        self.supernode_of = {slot.name: t.name for t in self.topologies for slot in t.nodes}
        self.holders: dict[NodeName, set[model.GangKey]] = {n: set() for n in self.names}
        self.spare_target = cluster.spares_per_supernode if spares else 0
        self.spares: dict[str, list[NodeName]] = {t.name: [] for t in self.topologies}
        self._downs = 0
        for t in self.topologies:
            self.refill(t.name)

    def _supernode(self, s: int) -> model.SuperNodeTopology:
        c, name = self.cluster, f"sn-{s:03d}"
        slots = tuple(
            model.NodeSlot(
                name=NodeName(f"{name}-n{k:02d}"),
                supernode=name,
                domains=(f"{name}-rack-{k // c.nodes_per_rack:02d}",),
                cards=c.cards_per_node,
            )
            for k in range(c.nodes_per_supernode)
        )
        return model.SuperNodeTopology(name, CARD, slots, 0)

    # ---- gangs ------------------------------------------------------------------------------

    def place(self, gang: model.GangRequest) -> model.Placement | None:
        """The engine's placement of ``gang``, committed; None when it does not fit now."""
        verdict = engine.place(self.snapshot, gang)
        if not isinstance(verdict, model.Placement):
            return None
        self.commit(verdict)
        return verdict

    def commit(self, placement: model.Placement) -> None:
        self.snapshot.commit(placement)
        for a in placement.assignments:
            self.holders[a.node].add(placement.gang)

    def release(self, gang: model.GangKey, pods: Iterable[tuple[model.PodKey, NodeName]]) -> None:
        """Give back the cards of ``pods`` (pod, node) of ``gang``."""
        pods = list(pods)
        self.snapshot.release_pods(gang, [p for p, _ in pods])
        held = self.snapshot.held.get(gang, {})
        for _, node in pods:
            if not any(self.names[h[0]] == node for h in held.values()):
                self.holders[node].discard(gang)

    def free_cards(self, node: NodeName) -> frozenset[model.CardId]:
        return self.snapshot.free_cards(node)

    # ---- spares -----------------------------------------------------------------------------

    def refill(self, supernode: str) -> None:
        """Keep ``spare_target`` free spares in ``supernode``: the operator's rule, over its
        idle, fully healthy nodes."""
        free = self.spares[supernode]
        missing = self.spare_target - len(free)
        if missing <= 0:
            return
        t = self.topologies[int(supernode.removeprefix("sn-"))]
        full = frozenset(range(self.cluster.cards_per_node))
        infos = [
            inventory.NodeInfo(n.name, {}, True, {CARD: n.cards})
            for n in t.nodes
            if n.name not in free and self.free_cards(n.name) == full
        ]
        for node in inventory.choose_spares(infos, CARD, {}, missing):
            self._reserve(model.GangKey(SPARE + supernode), node, full)
            free.append(node)

    def take_spare(self, supernode: str, node: NodeName) -> None:
        """SpareSwap took ``node``: it leaves the spares; the caller commits the moved rank."""
        self.spares[supernode].remove(node)
        self.release(model.GangKey(SPARE + supernode), [(model.PodKey(SPARE + node), node)])

    # ---- cards out of service ---------------------------------------------------------------

    def take_down(self, node: NodeName, cards: Iterable[int]) -> None:
        """The free ones of ``cards`` leave service until :meth:`repair` (held cards were
        released by the caller first; a spare hit loses its place among the spares)."""
        sn = self.supernode_of[node]
        if node in self.spares[sn]:
            self.spares[sn].remove(node)
            self.release(model.GangKey(SPARE + sn), [(model.PodKey(SPARE + node), node)])
        down = frozenset(cards) & self.free_cards(node)
        if down:
            self._reserve(model.GangKey(DOWN + node), node, down)

    def repair(self, node: NodeName) -> None:
        """Every card of ``node`` taken down is back in service."""
        gang = model.GangKey(DOWN + node)
        pods = [(p, node) for p in self.snapshot.held.get(gang, {})]
        self.release(gang, pods)
        self.refill(self.supernode_of[node])

    def _reserve(self, gang: model.GangKey, node: NodeName, cards: frozenset[int]) -> None:
        self._downs += 1
        pod = model.PodKey(SPARE + node if gang.startswith(SPARE) else f"{gang}/{self._downs}")
        taken = tuple(model.CardId(c) for c in sorted(cards))
        self.commit(model.Placement(gang, (model.Assignment(pod, node, taken),)))
