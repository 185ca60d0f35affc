"""Which gang specs can never be served on a topology, and why (the permanent reasons).

Pure. :func:`matrixpool.placement.engine.check_servable` answers the controllers with it, and
:func:`matrixpool.placement.engine.place` asks it first on every gang (through the summaries a
snapshot keeps), so both say the same thing. A :class:`Summary` condenses one supernode's static
tree into the few numbers the checks need; summaries of every supernode merge into one for gangs
that may go anywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from matrixpool.placement import cards
from matrixpool.placement.model import (
    Affinity,
    GangRequest,
    NodeSlot,
    Reason,
    SuperNodeTopology,
    Unplaceable,
)

UNKNOWN_SUPERNODE = "UnknownSuperNode"  # spec.superNode names no SuperNode
NODE_TOO_SMALL = "NodeTooSmall"  # a pod asks more cards than any candidate node has
CARD_GROUP_MISMATCH = "CardGroupMismatch"  # above a card group but not a multiple of it
TOO_MANY_CARDS = "TooManyCards"  # the gang outgrows its named supernode (outside spares)
GROUP_TOO_LARGE = "GroupTooLarge"  # groupSize ranks outgrow every rack of the supernode
INVALID_CARDS = "InvalidCards"  # a pod asks fewer than one card
NO_NODES = "NoNodes"  # the supernode's nodeSelector matches no node (none to place on at all)

NodeKind = tuple[int, cards.Shape]  # (cards on the node, its card-group masks)


@dataclass(frozen=True)
class Summary:
    """What the permanent checks need to know about one supernode (or all of them)."""

    names: tuple[str, ...]  # the supernodes summarised
    largest_node: int  # most cards on one node
    kinds: frozenset[NodeKind]  # the node kinds present
    cards_outside_spares: int  # all cards but those of the `spares` smallest nodes
    racks: tuple[tuple[NodeKind, ...], ...] = ()  # node kinds per rack (one supernode only)

    def rack_pods(self, cards_per_pod: int) -> int:
        """The most pods of ``cards_per_pod`` cards one empty rack holds."""
        return max((sum(_pods(k, cards_per_pod) for k in rack) for rack in self.racks), default=0)


@functools.lru_cache(maxsize=4096)
def summary(topology: SuperNodeTopology) -> Summary:
    """The summary of one supernode (memoised: topologies are immutable)."""
    kinds = [_kind(n) for n in topology.nodes]
    sizes = sorted(n.cards for n in topology.nodes)
    racks: dict[tuple[str, ...], list[NodeKind]] = {}
    for node, kind in zip(topology.nodes, kinds, strict=True):
        racks.setdefault(node.domains, []).append(kind)
    return Summary(
        names=(topology.name,),
        largest_node=sizes[-1] if sizes else 0,
        kinds=frozenset(kinds),
        cards_outside_spares=sum(sizes) - sum(sizes[: topology.spares]),
        racks=tuple(tuple(r) for r in racks.values()),
    )


def merged(summaries: Iterable[Summary]) -> Summary:
    """One summary for "any supernode": largest node and node kinds of all of them."""
    items = list(summaries)
    return Summary(
        names=tuple(n for s in items for n in s.names),
        largest_node=max((s.largest_node for s in items), default=0),
        kinds=frozenset(k for s in items for k in s.kinds),
        cards_outside_spares=max((s.cards_outside_spares for s in items), default=0),
    )


def check(candidates: Summary | None, gang: GangRequest) -> Unplaceable | None:
    """The permanent reason ``gang`` can never be served by ``candidates``, or None.

    ``candidates`` is the named supernode's summary, the merged summary of all supernodes when
    none is named, or None when the named supernode does not exist.
    """
    reason = _unknown(candidates, gang) or _empty(candidates, gang)
    reason = reason or _cards_reason(candidates, gang)
    if reason is None and candidates is not None and _named_and_required(gang):
        reason = _too_many(candidates, gang) or _group_too_large(candidates, gang)
    return Unplaceable(gang.gang, (reason,), permanent=True) if reason else None


def _named_and_required(gang: GangRequest) -> bool:
    return gang.supernode is not None and gang.affinity is Affinity.REQUIRED


def _unknown(candidates: Summary | None, gang: GangRequest) -> Reason | None:
    if candidates is not None and candidates.names:
        return None
    if gang.supernode is None:
        return Reason(UNKNOWN_SUPERNODE, "no SuperNode exists to place the gang on")
    return Reason(UNKNOWN_SUPERNODE, f"spec.superNode {gang.supernode!r} names no SuperNode")


def _empty(candidates: Summary | None, gang: GangRequest) -> Reason | None:
    """A supernode without a single node says so, not that its largest node has 0 cards."""
    if candidates is None or candidates.kinds:
        return None
    if gang.supernode is not None and candidates.names == (gang.supernode,):
        return Reason(
            NO_NODES,
            f"spec.superNode {gang.supernode} has no node: its spec.nodeSelector matches none",
        )
    names = ", ".join(candidates.names)
    return Reason(NO_NODES, f"no SuperNode has a node: the spec.nodeSelector of {names} match none")


def _cards_reason(candidates: Summary | None, gang: GangRequest) -> Reason | None:
    if candidates is None:
        return None
    where = _where(gang)
    for size in sorted({p.cards for p in gang.pods}):
        if size < 1:
            return Reason(INVALID_CARDS, f"{gang.cards_field} {size} asks for no card")
        if size > candidates.largest_node:
            return Reason(
                NODE_TOO_SMALL,
                f"{gang.cards_field} {size} is more than the {candidates.largest_node} cards "
                f"of the largest node {where}",
            )
        if not any(_pods(kind, size) for kind in candidates.kinds):
            return Reason(CARD_GROUP_MISMATCH, _mismatch(gang, size, candidates))
    return None


def _mismatch(gang: GangRequest, size: int, candidates: Summary) -> str:
    group = max(max(g.bit_count() for g in shape) for _, shape in candidates.kinds)
    return (
        f"{gang.cards_field} {size} is more than a card group of {group} cards but not a "
        f"multiple of it; such a pod would straddle card groups"
    )


def _too_many(candidates: Summary, gang: GangRequest) -> Reason | None:
    need = sum(p.cards for p in gang.pods)
    if need <= candidates.cards_outside_spares:
        return None
    return Reason(
        TOO_MANY_CARDS,
        f"the gang needs {need} cards ({len(gang.pods)} pods, {gang.cards_field} "
        f"{_sizes(gang)}) but spec.superNode {gang.supernode} has "
        f"{candidates.cards_outside_spares} outside its spare nodes",
    )


def _group_too_large(candidates: Summary, gang: GangRequest) -> Reason | None:
    group = gang.group_size or 1
    if group <= 1 or not gang.pods:
        return None
    size = max(p.cards for p in gang.pods)
    room = candidates.rack_pods(size)
    if min(group, len(gang.pods)) <= room:
        return None
    return Reason(
        GROUP_TOO_LARGE,
        f"spec.placement.groupSize {group} asks for {group} pods of {size} cards in one rack, "
        f"but the largest rack of supernode {gang.supernode} holds {room}",
    )


def _where(gang: GangRequest) -> str:
    return f"of supernode {gang.supernode}" if gang.supernode else "of any supernode"


def _sizes(gang: GangRequest) -> str:
    return "/".join(str(s) for s in sorted({p.cards for p in gang.pods}))


def _kind(node: NodeSlot) -> NodeKind:
    return node.cards, cards.shape_of(node.cards, node.card_groups)


def _pods(kind: NodeKind, cards_per_pod: int) -> int:
    size, shape = kind
    return cards.fitter(shape).capacity((1 << size) - 1, cards_per_pod)


def summaries(topologies: Sequence[SuperNodeTopology]) -> dict[str, Summary]:
    """The summary of each supernode by name."""
    return {t.name: summary(t) for t in topologies}
