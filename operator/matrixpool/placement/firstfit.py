"""The first-fit baseline the benchmark compares the engine with.

Pure. ``benchmarks/placement.py`` places the same stream of gangs with :class:`FirstFit` and
with the engine. First fit puts each pod on the first node, in name order over all supernodes,
with enough free cards, taking its lowest free card ids: no supernode affinity, racks, card
groups, spread, best fit, nor what pods ask of nodes besides cards (``nodefit``). It keeps
what any placement must keep (gangs all-or-nothing; spares, unhealthy cards and NotReady nodes
untouched) by working on the same :class:`Snapshot`.

A max-segment tree over the nodes' free-card counts, in name order, finds "the first node with
at least ``c`` free cards" in O(log nodes) instead of a scan of every node.
"""

from __future__ import annotations

from matrixpool.placement import cards
from matrixpool.placement.model import (
    Assignment,
    GangKey,
    GangRequest,
    Placement,
    Reason,
    Unplaceable,
)
from matrixpool.placement.snapshot import Snapshot


class FirstFit:
    """First fit over one snapshot; commit through it so its index follows the snapshot."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        layout = snapshot.layout
        placeable = [i for i, r in enumerate(layout.node_rack) if r >= 0]
        self.order = sorted(placeable, key=lambda i: layout.names[i])  # position → node
        self.size = 1 << max(1, len(self.order) - 1).bit_length()
        self.tree = [0] * (2 * self.size)  # max free cards per subtree
        for position, i in enumerate(self.order):
            self.tree[self.size + position] = snapshot.free[i].bit_count()
        for k in range(self.size - 1, 0, -1):
            self.tree[k] = max(self.tree[2 * k], self.tree[2 * k + 1])
        self.position = {i: p for p, i in enumerate(self.order)}

    def place(self, gang: GangRequest) -> Placement | Unplaceable:
        """Each pod on the first node with enough free cards; nothing when one does not fit."""
        snap, layout = self.snapshot, self.snapshot.layout
        out: list[Assignment] = []
        touched: list[int] = []
        with snap.tentative():
            for pod in gang.pods:
                position = self._first(pod.cards)
                if position is None:
                    break
                i = self.order[position]
                mask = cards.lowest(snap.free[i], pod.cards)
                snap.take(i, mask, None)
                self._update(position)
                touched.append(position)
                sn = layout.sn_names[layout.node_sn[i]]
                out.append(Assignment(pod.pod, layout.names[i], cards.cards_of(mask), sn))
        for position in touched:
            self._update(position)
        if len(out) < len(gang.pods):
            reason = Reason("InsufficientCards", "first fit found no node for every pod")
            return Unplaceable(gang.gang, (reason,))
        return Placement(gang.gang, tuple(out), gang.priority, gang.spread_group)

    def commit(self, placement: Placement) -> None:
        self.snapshot.commit(placement)
        for a in placement.assignments:
            self._update(self.position[self.snapshot.layout.index[a.node]])

    def release(self, gang: GangKey) -> None:
        snapshot = self.snapshot
        nodes = [held[0] for held in snapshot.held.get(gang, {}).values() if held[0] >= 0]
        snapshot.release(gang)
        for i in nodes:
            self._update(self.position[i])

    def _first(self, need: int) -> int | None:
        tree = self.tree
        if tree[1] < need:
            return None
        k = 1
        while k < self.size:
            k = 2 * k if tree[2 * k] >= need else 2 * k + 1
        return k - self.size

    def _update(self, position: int) -> None:
        tree = self.tree
        k = self.size + position
        tree[k] = self.snapshot.free[self.order[position]].bit_count()
        k //= 2
        while k:
            tree[k] = max(tree[2 * k], tree[2 * k + 1])
            k //= 2


def place(snapshot: Snapshot, gang: GangRequest) -> Placement | Unplaceable:
    """First fit of one gang (builds the index: O(nodes); use :class:`FirstFit` for streams)."""
    return FirstFit(snapshot).place(gang)
