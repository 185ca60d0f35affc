"""The supernodes' tiers written in the peers' own objects, so a cluster that also runs Kueue or
Volcano sees the same supernodes and racks as matrixpool (``matrixpool export topology``).

Called by matrixpool.cli with the SuperNodes and Nodes it read; pure, tested in
tests/unit/interop/test_topology.py. Tiers, coarse to fine: the supernode (node label
``matrixpool.dev/supernode``), then each SuperNode's ``spec.topologyKeys``, then the node.

- :func:`kueue`: one Kueue ``Topology`` per distinct list of levels (supernode label, the
  topologyKeys, ``kubernetes.io/hostname``) and one ``ResourceFlavor`` per SuperNode (so per
  card resource) naming it, whose ``nodeLabels`` are the SuperNode's ``matchLabels``. Kueue
  v0.17 wants 1..8 nodeLabels on a TAS flavor and keeps them immutable, so one flavor cannot
  select several supernodes; a ClusterQueue lists the supernodes' flavors instead.
- :func:`volcano`: Volcano ``HyperNode``s: one per domain of the finest topology key holding its
  nodes by exact name, one per coarser domain holding the finer HyperNodes, one per supernode;
  tiers numbered from the finest (1), the supernodes all on one tier above the deepest key.

What the peers would not see (a member node lacking a level's label, a supernode without
nodes) comes back as ``Export.warnings``, beside the objects.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from matrixpool.api import common, labels
from matrixpool.api import supernode as supernode_api

HOSTNAME = "kubernetes.io/hostname"
KUEUE_API = "kueue.x-k8s.io/v1beta2"  # the version Kueue v0.17 stores (v1beta1 is deprecated)
VOLCANO_API = "topology.volcano.sh/v1alpha1"  # HyperNode, Volcano v1.12 and later
MANAGED_BY = {"app.kubernetes.io/managed-by": "matrixpool"}  # on every exported object
FORMATS = ("kueue", "volcano")
KUEUE_MAX_NODE_LABELS = 8  # a ResourceFlavor's spec.nodeLabels holds at most 8
# On each ResourceFlavor: the extended resource its supernode counts as cards (what a
# ClusterQueue covers with it).
CARD_RESOURCE_ANNOTATION = "matrixpool.dev/card-resource"

Body = dict[str, Any]
K = TypeVar("K")


@dataclass(frozen=True)
class Node:
    """A member node: its name and labels."""

    name: str
    labels: Mapping[str, str]


@dataclass(frozen=True)
class Pool:
    """One SuperNode as the export sees it."""

    name: str  # the SuperNode's name
    card_resource: str  # spec.cardResource
    topology_keys: tuple[str, ...]  # spec.topologyKeys, coarse → fine
    selector: common.LabelSelector  # spec.nodeSelector
    nodes: tuple[Node, ...]  # the nodes the selector matches, by name


@dataclass(frozen=True)
class Export:
    """The objects to apply, and what the peer will not see as matrixpool does."""

    objects: list[Body] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def pools(
    supernodes: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]]
) -> list[Pool]:
    """SuperNode and Node bodies (API JSON) as pools, by SuperNode name."""
    members = sorted(
        (Node(n["metadata"]["name"], dict(n["metadata"].get("labels") or {})) for n in nodes),
        key=lambda n: n.name,
    )
    result = []
    for body in supernodes:
        parsed = supernode_api.parse(body)
        spec = parsed.spec
        result.append(
            Pool(
                name=parsed.metadata.name,
                card_resource=spec.card_resource,
                topology_keys=tuple(spec.topology_keys),
                selector=spec.node_selector,
                nodes=tuple(n for n in members if spec.node_selector.matches(n.labels)),
            )
        )
    return sorted(result, key=lambda p: p.name)


def export(fmt: str, pools_: Sequence[Pool], prefix: str = "matrixpool") -> Export:
    """The objects of one format (:data:`FORMATS`)."""
    if fmt == "kueue":
        return kueue(pools_, prefix)
    if fmt == "volcano":
        return volcano(pools_)
    raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")


# --- Kueue ------------------------------------------------------------------------------------
def kueue_levels(pool: Pool) -> tuple[str, ...]:
    """The supernode label, the topologyKeys, the hostname (once, last: Kueue's rule)."""
    keys = [k for k in pool.topology_keys if k not in (labels.SUPERNODE, HOSTNAME)]
    return (labels.SUPERNODE, *keys, HOSTNAME)


def kueue(pools_: Sequence[Pool], prefix: str = "matrixpool") -> Export:
    """Topologies and ResourceFlavors (kueue.x-k8s.io/v1beta2) for Topology Aware Scheduling."""
    # 1. One Topology per distinct list of levels, named after them.
    all_levels = list(dict.fromkeys(kueue_levels(pool) for pool in pools_))
    topologies = _distinct(
        {
            levels: "-".join([prefix, *(_slug(_tail(k)) for k in levels[:-1])])
            for levels in all_levels
        }
    )
    # 2. One flavor per supernode: Kueue wants at least one nodeLabel on a TAS flavor, and keeps
    #    them immutable, so a flavor cannot select several supernodes by what their labels share.
    flavors = _distinct({pool.name: f"{prefix}-{_slug(pool.name)}" for pool in pools_})
    objects: list[Body] = []
    warnings: list[str] = []
    for levels in all_levels:
        objects.append(_kueue_topology(topologies[levels], levels))
        for pool in (p for p in pools_ if kueue_levels(p) == levels):
            node_labels, reason = _flavor_labels(pool)
            if reason:
                warnings.append(f"SuperNode {pool.name}: no ResourceFlavor: {reason}")
                continue
            objects.append(_kueue_flavor(flavors[pool.name], topologies[levels], pool, node_labels))
    warnings += [w for pool in pools_ for w in _missing(pool, kueue_levels(pool), "Kueue")]
    return Export(objects, warnings)


def _kueue_topology(name: str, levels: tuple[str, ...]) -> Body:
    return {
        "apiVersion": KUEUE_API,
        "kind": "Topology",
        "metadata": {"name": name, "labels": dict(MANAGED_BY)},
        "spec": {"levels": [{"nodeLabel": level} for level in levels]},
    }


def _flavor_labels(pool: Pool) -> tuple[dict[str, str], str]:
    """The flavor's nodeLabels: the selector's matchLabels, else the supernode label its nodes
    share; or why there are none (Kueue takes 1..8 exact labels)."""
    if pool.selector.match_labels:
        if len(pool.selector.match_labels) > KUEUE_MAX_NODE_LABELS:
            return {}, f"more than {KUEUE_MAX_NODE_LABELS} matchLabels in its nodeSelector"
        return dict(pool.selector.match_labels), ""
    values = {n.labels.get(labels.SUPERNODE) for n in pool.nodes}
    if len(values) == 1 and None not in values:
        return {labels.SUPERNODE: str(values.pop())}, ""
    return {}, f"its nodeSelector has no matchLabels and its nodes share no {labels.SUPERNODE}"


def _kueue_flavor(name: str, topology: str, pool: Pool, node_labels: dict[str, str]) -> Body:
    metadata = {
        "name": name,
        "labels": {**MANAGED_BY, labels.SUPERNODE: pool.name},
        "annotations": {CARD_RESOURCE_ANNOTATION: pool.card_resource},
    }
    spec = {"nodeLabels": node_labels, "topologyName": topology}
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": metadata, "spec": spec}


# --- Volcano ----------------------------------------------------------------------------------
def volcano(pools_: Sequence[Pool]) -> Export:
    """HyperNodes (topology.volcano.sh/v1alpha1): domains of the topologyKeys, then supernodes."""
    top = max((len(p.topology_keys) for p in pools_), default=0) + 1
    # 1. Every domain of every pool, as the key values down to it (coarse first).
    paths = {pool.name: _paths(pool) for pool in pools_}
    # 2. Names: the supernode's; a domain's is its parent's plus its value, unless the value
    #    already starts with the supernode's name (sn-0 → sn-0-rack-0).
    wanted: dict[tuple[str, tuple[str, ...]], str] = {}
    for pool in pools_:
        own = wanted[(pool.name, ())] = _slug(pool.name)
        for path in paths[pool.name]:
            parent, value = wanted[(pool.name, path[:-1])], _slug(path[-1])
            wanted[(pool.name, path)] = (
                value if value.startswith(own + "-") else f"{parent}-{value}"
            )
    names = _distinct(wanted)
    # 3. Each supernode (tier ``top``), then its domains (finest: tier 1).
    objects: list[Body] = []
    for pool in pools_:
        for path in [(), *paths[pool.name]]:
            depth = len(path)
            if depth == len(pool.topology_keys):
                members = _node_members(pool, path)
            else:
                below = [p for p in paths[pool.name] if len(p) == depth + 1 and p[:depth] == path]
                members = [_hypernode_member(names[(pool.name, p)]) for p in below]
            if depth == 0:
                tier, tier_name = top, "supernode"
            else:
                tier = len(pool.topology_keys) - depth + 1
                tier_name = _slug(_tail(pool.topology_keys[depth - 1]))
            if members:  # Volcano takes no empty member list: a supernode with no domains
                objects.append(_hypernode(names[(pool.name, path)], tier, tier_name, pool, members))
    warnings = [w for pool in pools_ for w in _missing(pool, pool.topology_keys, "Volcano")]
    return Export(objects, warnings)


def _paths(pool: Pool) -> list[tuple[str, ...]]:
    """Every domain of the pool's keys as the values down to it, sorted (coarse first)."""
    full = {
        tuple(n.labels[k] for k in pool.topology_keys)
        for n in pool.nodes
        if all(k in n.labels for k in pool.topology_keys)
    }
    paths = {path[:depth] for path in full for depth in range(1, len(path) + 1)}
    return sorted(paths, key=lambda p: (len(p), [_natural(v) for v in p]))


def _node_members(pool: Pool, path: tuple[str, ...]) -> list[Body]:
    """The nodes of one finest domain, each by exact name: Volcano's admission webhook takes
    only exactMatch or regexMatch members (it refuses labelMatch, which its CRD allows)."""
    domain = dict(zip(pool.topology_keys, path, strict=True))
    names = [n.name for n in pool.nodes if all(n.labels.get(k) == v for k, v in domain.items())]
    return [{"type": "Node", "selector": {"exactMatch": {"name": name}}} for name in names]


def _hypernode_member(name: str) -> Body:
    return {"type": "HyperNode", "selector": {"exactMatch": {"name": name}}}


def _hypernode(name: str, tier: int, tier_name: str, pool: Pool, members: list[Body]) -> Body:
    return {
        "apiVersion": VOLCANO_API,
        "kind": "HyperNode",
        "metadata": {"name": name, "labels": {**MANAGED_BY, labels.SUPERNODE: pool.name}},
        "spec": {"tier": tier, "tierName": tier_name, "members": members},
    }


# --- shared -----------------------------------------------------------------------------------
def _missing(pool: Pool, keys: Iterable[str], peer: str) -> list[str]:
    """What the peer will not see: a supernode without nodes, nodes lacking a level's label."""
    if not pool.nodes:
        return [f"SuperNode {pool.name}: its nodeSelector matches no node"]
    warnings = []
    for key in keys:
        lacking = [n.name for n in pool.nodes if key not in n.labels]
        if lacking:
            shown = ", ".join(lacking[:3]) + (", ..." if len(lacking) > 3 else "")
            warnings.append(
                f"SuperNode {pool.name}: {len(lacking)} of {len(pool.nodes)} nodes lack the label "
                f"{key} ({shown}); {peer} leaves them out"
            )
    return warnings


def _natural(value: str) -> tuple[tuple[int, str], ...]:
    """Sort key putting rack-2 before rack-10."""
    parts = re.split(r"(\d+)", value)
    return tuple((int(part), "") if part.isdigit() else (-1, part) for part in parts)


def _tail(key: str) -> str:
    """The name part of a label key or resource name: matrixpool.dev/rack → rack."""
    return key.rsplit("/", 1)[-1]


def _slug(text: str) -> str:
    """A DNS-1123 name part: lowercase, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def _distinct(wanted: Mapping[K, str]) -> dict[K, str]:
    """The wanted names, a short hash of the key appended where two keys want one name."""
    counts: dict[str, int] = {}
    for name in wanted.values():
        counts[name] = counts.get(name, 0) + 1
    return {
        key: name if counts[name] == 1 else f"{name}-{_digest(repr(key))}"
        for key, name in wanted.items()
    }


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:6]
