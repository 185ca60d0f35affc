"""Tier-1 peer assignment: which daemons keep in memory the copies of a node's shards.

Pure. The operator calls ``assign_peers`` when it binds a TrainingJob (and again after a
SpareSwap or Reschedule) and hands each trainer its node's peers (``MATRIXPOOL_CKPT_PEERS``);
``matrixpool sim`` and the tests call it the same way. DESIGN.md: tier-1 copies live "on
``peerReplicas`` daemons on other nodes in another rack", so that one rack failing loses no
committed step.

Rule, in phases:

1. Candidates are every node of ``rack_of`` (the caller decides which nodes may hold copies:
   the job's nodes, or the whole supernode) and the givers (nodes running ranks of the job),
   laid in a ring that interleaves the racks: first node of each rack, then the second of
   each, and so on (racks and nodes by name).
2. Each giver walks the ring from itself and takes the first ``peer_replicas`` nodes in
   ANOTHER rack. Copies spread by position: with racks of equal size (and
   ``peer_replicas`` no more than the nodes of the other racks) every node holds the copies
   of exactly ``peer_replicas`` givers; with unequal racks the nodes of smaller racks hold
   more, being the only "other rack" of more nodes. Weights (ranks per node) are not
   balanced: a gang's nodes run the same number of ranks.
3. Degraded cases, named in ``PeerAssignment.degraded`` (empty when none): with one rack only,
   holders are other nodes of the same rack (a node failing loses nothing, a rack failing
   loses tier 1); with fewer other-rack nodes than ``peer_replicas``, the rest are the next
   nodes of the giver's rack on the ring; with fewer other nodes than ``peer_replicas``, a
   giver gets fewer. A giver always has a holder in another rack when another rack exists.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from matrixpool_recovery.policy import NodeName


@dataclass(frozen=True)
class PeerAssignment:
    """Holders of each node's tier-1 copies, and what the assignment could not guarantee."""

    peers: Mapping[NodeName, tuple[NodeName, ...]]  # giver -> its holders, chosen order
    degraded: str = ""  # "" when every giver has peer_replicas holders, one in another rack


def assign_peers(
    ranks_by_node: Mapping[NodeName, Collection[int]],
    rack_of: Mapping[NodeName, str],
    peer_replicas: int,
) -> PeerAssignment:
    """Holders for every node that runs ranks; see the module docstring for the rule."""
    # 1. Givers and the ring of candidates, racks interleaved.
    givers = sorted(n for n, ranks in ranks_by_node.items() if ranks)
    ring = _ring(set(rack_of) | set(givers), rack_of)
    position = {node: i for i, node in enumerate(ring)}
    # 2. The first peer_replicas nodes of other racks after each giver, then its own rack.
    peers = {giver: _holders(giver, ring, position, rack_of, peer_replicas) for giver in givers}
    # 3. Say what could not be guaranteed.
    return PeerAssignment(peers, _degraded(peers, rack_of, peer_replicas))


def _ring(nodes: Collection[NodeName], rack_of: Mapping[NodeName, str]) -> list[NodeName]:
    by_rack: dict[str, list[NodeName]] = {}
    for node in sorted(nodes):
        by_rack.setdefault(rack_of.get(node, ""), []).append(node)
    rows = itertools.zip_longest(*(by_rack[r] for r in sorted(by_rack)))
    return [node for row in rows for node in row if node is not None]


def _holders(
    giver: NodeName,
    ring: list[NodeName],
    position: Mapping[NodeName, int],
    rack_of: Mapping[NodeName, str],
    replicas: int,
) -> tuple[NodeName, ...]:
    """Walking the ring from ``giver``: the first ``replicas`` nodes of other racks, or when
    there are fewer, those and then the next nodes of its own rack. The walk stops at the
    last one needed (on a ring that interleaves racks, a few steps): every daemon of a
    supernode is a giver, so a walk of the whole ring each made this quadratic in its nodes."""
    if replicas <= 0:
        return ()
    at, rack = position[giver], rack_of.get(giver, "")
    away: list[NodeName] = []
    near: list[NodeName] = []
    for step in range(1, len(ring)):
        node = ring[(at + step) % len(ring)]
        if rack_of.get(node, "") != rack:
            away.append(node)
            if len(away) == replicas:
                return tuple(away)
        else:
            near.append(node)
    return tuple((away + near)[:replicas])


def _degraded(
    peers: Mapping[NodeName, tuple[NodeName, ...]], rack_of: Mapping[NodeName, str], replicas: int
) -> str:
    notes = []
    racks = {rack_of.get(n, "") for n in set(rack_of) | set(peers)}
    if replicas > 0 and len(racks) < 2:
        notes.append(f"one rack only ({sorted(racks)}): a rack failure loses tier 1")
    short = sorted(g for g, held in peers.items() if len(held) < replicas)
    if short:
        notes.append(f"nodes {short[:8]} have fewer than {replicas} peers (too few other nodes)")
    near = sorted(g for g, held in peers.items() if _same_rack(g, held, rack_of) and len(racks) > 1)
    if near:
        notes.append(f"nodes {near[:8]} share a rack with some of their peers (too few racks)")
    return "; ".join(notes)


def _same_rack(
    giver: NodeName, held: tuple[NodeName, ...], rack_of: Mapping[NodeName, str]
) -> bool:
    return any(rack_of.get(h, "") == rack_of.get(giver, "") for h in held)
