"""The card inventory of a supernode: which nodes belong to it and how its cards stand.

Pure (no kopf, no Kubernetes client). The SuperNode handler feeds it node and pod facts read
from the API and writes the returned :class:`PoolSummary` into ``status``; placement (gang
scheduling) builds on the same :class:`NodeInfo` records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NewType

from matrixpool.placement import nodefit

NodeName = NewType("NodeName", str)


@dataclass(frozen=True)
class Requirement:
    """One ``matchExpressions`` entry of a label selector."""

    key: str
    operator: str  # In | NotIn | Exists | DoesNotExist
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator == "In":
            return present and labels[self.key] in self.values
        if self.operator == "NotIn":
            return not present or labels[self.key] not in self.values
        if self.operator == "Exists":
            return present
        if self.operator == "DoesNotExist":
            return not present
        raise ValueError(f"unknown selector operator {self.operator!r}")


@dataclass(frozen=True)
class Selector:
    """A Kubernetes label selector (matchLabels AND matchExpressions)."""

    match_labels: Mapping[str, str] = field(default_factory=dict)
    requirements: tuple[Requirement, ...] = ()

    @classmethod
    def from_spec(cls, spec: Mapping[str, object] | None) -> Selector:
        """Build from the wire form ``{matchLabels: {...}, matchExpressions: [...]}``."""
        spec = spec or {}
        labels = spec.get("matchLabels") or {}
        expressions = spec.get("matchExpressions") or []
        assert isinstance(labels, Mapping)
        assert isinstance(expressions, list)
        return cls(
            match_labels={str(k): str(v) for k, v in labels.items()},
            requirements=tuple(
                Requirement(e["key"], e["operator"], frozenset(e.get("values") or ()))
                for e in expressions
            ),
        )

    @property
    def empty(self) -> bool:
        return not self.match_labels and not self.requirements

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` satisfy the selector; an empty selector matches nothing here,
        since a supernode that claims every node is a mistake, not a pool."""
        if self.empty:
            return False
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.requirements
        )


@dataclass(frozen=True)
class NodeInfo:
    """What the inventory needs to know about one Node."""

    name: NodeName
    labels: Mapping[str, str]
    ready: bool  # Ready condition True (and not cordoned)
    cards: Mapping[str, int]  # allocatable extended resources, e.g. {"huawei.com/Ascend910": 8}
    unhealthy: frozenset[int] = frozenset()  # card indices from matrixpool.dev/unhealthy-cards
    endpoint: str = ""  # the checkpoint daemon's host:port, from its Lease (k8s.daemonleases)
    down: bool = False  # Ready False or Unknown (a cordoned node is not ready, but not down)
    allocatable: Mapping[str, int] = field(default_factory=dict)  # all of it; cpu in millicores
    taints: tuple[nodefit.Taint, ...] = ()  # spec.taints
    cordoned: bool = False  # spec.unschedulable: no new pods; not a fault for recovery
    address: str = ""  # status.addresses' InternalIP (the HCCL rank table's server_id)


@dataclass(frozen=True)
class PoolSummary:
    """The numbers a SuperNode's status reports."""

    nodes_total: int
    nodes_ready: int
    cards_total: int
    cards_allocatable: int  # healthy, on ready nodes, not held back as spares
    cards_allocated: int  # requested by live pods bound to member nodes
    cards_unhealthy: int  # on NotReady nodes, or marked unhealthy
    cards_spare: int  # on the whole nodes held back for recovery
    spare_nodes: tuple[NodeName, ...]


def parse_card_list(text: str | None) -> tuple[frozenset[int], list[str]]:
    """Card indices of an annotation like ``"3,5"`` and the tokens that are not indices."""
    cards: set[int] = set()
    bad: list[str] = []
    for token in (text or "").split(","):
        token = token.strip()
        if not token:
            continue
        if token.isdigit():
            cards.add(int(token))
        else:
            bad.append(token)
    return frozenset(cards), bad


def members(selector: Selector, nodes: Iterable[NodeInfo]) -> list[NodeInfo]:
    """The nodes a supernode's selector picks, in name order."""
    return sorted((n for n in nodes if selector.matches(n.labels)), key=lambda n: n.name)


def choose_spares(
    nodes: list[NodeInfo], card_resource: str, allocated: Mapping[NodeName, int], count: int
) -> tuple[NodeName, ...]:
    """Rule: spares are ``count`` whole nodes that are ready, fully healthy and idle, taken
    from the end of the name order so the choice is stable across restarts."""
    candidates = [
        n.name
        for n in reversed(nodes)
        if n.ready
        and not _bad_cards(n, card_resource)
        and not allocated.get(n.name)
        and n.cards.get(card_resource, 0) > 0
    ]
    return tuple(sorted(candidates[:count]))


def summarize(
    nodes: list[NodeInfo], card_resource: str, allocated: Mapping[NodeName, int], spares: int
) -> PoolSummary:
    """Count nodes and cards of one supernode's member ``nodes``."""
    spare_nodes = choose_spares(nodes, card_resource, allocated, spares)
    total = unhealthy = spare = 0
    for node in nodes:
        cards = node.cards.get(card_resource, 0)
        total += cards
        bad = cards if not node.ready else _bad_cards(node, card_resource)
        unhealthy += bad
        if node.name in spare_nodes:
            spare += cards
    return PoolSummary(
        nodes_total=len(nodes),
        nodes_ready=sum(1 for n in nodes if n.ready),
        cards_total=total,
        cards_allocatable=total - unhealthy - spare,
        cards_allocated=sum(allocated.get(n.name, 0) for n in nodes),
        cards_unhealthy=unhealthy,
        cards_spare=spare,
        spare_nodes=spare_nodes,
    )


def _bad_cards(node: NodeInfo, card_resource: str) -> int:
    """Unhealthy card indices that exist on the node (out-of-range indices are ignored)."""
    cards = node.cards.get(card_resource, 0)
    return sum(1 for c in node.unhealthy if 0 <= c < cards)
