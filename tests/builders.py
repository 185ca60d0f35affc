"""Test builders that read like sentences (after Kueue's testing wrappers).

    node("n1").cards(8).rack("r1").unhealthy(3)
    node("n2").room(cpu="16", memory="64Gi").taint("dedicated", "infer").label("zone", "a")
    supernode("sn-a").racks(12, nodes=4).cards(8).groups([0, 1, 2, 3], [4, 5, 6, 7]).spares(1)
    gang("ns/j").pods(4, cards=8).priority(100).preferred().group_size(2)
    gang("ns/j").pods(2, cards=8).asks(cpu="10").tolerates("dedicated").selects(zone="a")
    holding("ns/old").on("sn-a-node-00", cards=[0, 1]).priority(5)

Builders are immutable: every call returns a new builder, so a half-built one can be shared
and extended safely. ``.build()`` gives the frozen model object. Placement tests use them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from matrixpool.placement import model, nodefit, quantities
from matrixpool.placement.inventory import NodeName

CARD_RESOURCE = "huawei.com/Ascend910"


@dataclass(frozen=True)
class NodeBuilder:
    """One node: ``node("n1").cards(8).rack("r1")``."""

    name: str
    supernode: str = "sn-a"
    count: int = 8
    domains: tuple[str, ...] = ("r0",)
    card_groups: tuple[tuple[int, ...], ...] = ()
    bad: frozenset[int] = frozenset()
    ready: bool = True
    labels: tuple[tuple[str, str], ...] = ()
    taints: tuple[nodefit.Taint, ...] = ()
    resources: nodefit.Resources | None = None
    unschedulable: bool = False

    def cards(self, count: int) -> NodeBuilder:
        return dataclasses.replace(self, count=count)

    def rack(self, *domains: str) -> NodeBuilder:
        return dataclasses.replace(self, domains=domains)

    def groups(self, *groups: Iterable[int]) -> NodeBuilder:
        return dataclasses.replace(self, card_groups=tuple(tuple(g) for g in groups))

    def unhealthy(self, *cards: int) -> NodeBuilder:
        return dataclasses.replace(self, bad=self.bad | frozenset(cards))

    def not_ready(self) -> NodeBuilder:
        return dataclasses.replace(self, ready=False)

    def in_supernode(self, name: str) -> NodeBuilder:
        return dataclasses.replace(self, supernode=name)

    def room(self, **resources: str) -> NodeBuilder:
        """What the node leaves to matrixpool's pods besides cards (``cpu="16"``)."""
        return dataclasses.replace(self, resources=_resources(resources))

    def label(self, key: str, value: str) -> NodeBuilder:
        return dataclasses.replace(self, labels=tuple(sorted({*self.labels, (key, value)})))

    def taint(self, key: str, value: str = "", effect: str = "NoSchedule") -> NodeBuilder:
        return dataclasses.replace(self, taints=(*self.taints, nodefit.Taint(key, value, effect)))

    def cordoned(self) -> NodeBuilder:
        """``kubectl cordon``: no usable cards for new pods, and the cordon noted."""
        return dataclasses.replace(self, unschedulable=True)

    def build(self) -> model.NodeSlot:
        usable = frozenset(model.CardId(c) for c in range(self.count) if c not in self.bad)
        return model.NodeSlot(
            name=NodeName(self.name),
            supernode=self.supernode,
            domains=self.domains,
            cards=self.count,
            card_groups=tuple(tuple(model.CardId(c) for c in g) for g in self.card_groups),
            usable=(usable if self.bad else None)
            if self.ready and not self.unschedulable
            else frozenset(),
            labels=self.labels,
            taints=self.taints,
            room=self.resources,
            cordoned=self.unschedulable,
        )


@dataclass(frozen=True)
class SuperNodeBuilder:
    """Identical nodes in equal racks, named ``<sn>-node-NN``, with per-node exceptions."""

    name: str
    rack_count: int = 1
    per_rack: int = 4
    count: int = 8
    card_groups: tuple[tuple[int, ...], ...] = ()
    spare_nodes: int = 0
    bad: tuple[tuple[int, frozenset[int]], ...] = ()  # (node index, unhealthy cards)
    down: frozenset[int] = frozenset()  # NotReady node indices
    extra: tuple[NodeBuilder, ...] = ()
    resources: nodefit.Resources | None = None  # every node's room
    tweaks: tuple[tuple[int, Callable[[NodeBuilder], NodeBuilder]], ...] = ()

    def racks(self, count: int, nodes: int) -> SuperNodeBuilder:
        return dataclasses.replace(self, rack_count=count, per_rack=nodes)

    def cards(self, count: int) -> SuperNodeBuilder:
        return dataclasses.replace(self, count=count)

    def groups(self, *groups: Iterable[int]) -> SuperNodeBuilder:
        return dataclasses.replace(self, card_groups=tuple(tuple(g) for g in groups))

    def spares(self, count: int) -> SuperNodeBuilder:
        return dataclasses.replace(self, spare_nodes=count)

    def unhealthy(self, node_index: int, *cards: int) -> SuperNodeBuilder:
        return dataclasses.replace(self, bad=(*self.bad, (node_index, frozenset(cards))))

    def not_ready(self, *nodes: int) -> SuperNodeBuilder:
        return dataclasses.replace(self, down=self.down | frozenset(nodes))

    def room(self, **resources: str) -> SuperNodeBuilder:
        return dataclasses.replace(self, resources=_resources(resources))

    def where(self, index: int, tweak: Callable[[NodeBuilder], NodeBuilder]) -> SuperNodeBuilder:
        """Node ``index`` changed by ``tweak``: ``.where(0, lambda n: n.cordoned())``."""
        return dataclasses.replace(self, tweaks=(*self.tweaks, (index, tweak)))

    def with_node(self, extra: NodeBuilder) -> SuperNodeBuilder:
        return dataclasses.replace(self, extra=(*self.extra, extra.in_supernode(self.name)))

    def node_name(self, k: int) -> NodeName:
        return NodeName(f"{self.name}-node-{k:02d}")

    def build(self) -> model.SuperNodeTopology:
        slots = [self._node(k).build() for k in range(self.rack_count * self.per_rack)]
        slots += [n.build() for n in self.extra]
        slots.sort(key=lambda s: (s.domains, s.name))
        return model.SuperNodeTopology(self.name, CARD_RESOURCE, tuple(slots), self.spare_nodes)

    def _node(self, k: int) -> NodeBuilder:
        built = NodeBuilder(
            self.node_name(k),
            supernode=self.name,
            count=self.count,
            domains=(f"rack-{k // self.per_rack:02d}",),
            card_groups=self.card_groups,
            bad=frozenset(c for index, cards in self.bad if index == k for c in cards),
            resources=self.resources,
        )
        for index, tweak in self.tweaks:
            if index == k:
                built = tweak(built)
        return built.not_ready() if k in self.down else built


@dataclass(frozen=True)
class GangBuilder:
    """A gang: ``gang("ns/j").pods(4, cards=8).priority(100)``; pods are ``<gang>-<rank>``."""

    key: str
    sizes: tuple[int, ...] = ()
    value: int = 0
    named: str | None = None
    affinity: model.Affinity = model.Affinity.REQUIRED
    ranks_per_rack: int | None = None
    spread_group: str | None = None
    floor: int | None = None
    preemptible: bool = True
    needs: nodefit.Needs = nodefit.NO_NEEDS
    lost_s: float = 0.0

    def pods(self, count: int, cards: int) -> GangBuilder:
        return dataclasses.replace(self, sizes=self.sizes + (cards,) * count)

    def priority(self, value: int) -> GangBuilder:
        return dataclasses.replace(self, value=value)

    def on(self, supernode: str) -> GangBuilder:
        return dataclasses.replace(self, named=supernode)

    def preferred(self) -> GangBuilder:
        return dataclasses.replace(self, affinity=model.Affinity.PREFERRED)

    def group_size(self, size: int) -> GangBuilder:
        return dataclasses.replace(self, ranks_per_rack=size)

    def spread(self, group: str) -> GangBuilder:
        return dataclasses.replace(self, spread_group=group)

    def elastic(self, min_pods: int) -> GangBuilder:
        return dataclasses.replace(self, floor=min_pods)

    def not_preemptible(self) -> GangBuilder:
        return dataclasses.replace(self, preemptible=False)

    def loses(self, seconds: float) -> GangBuilder:
        """Each of its cards loses ``seconds`` of work if it stops now."""
        return dataclasses.replace(self, lost_s=seconds)

    def asks(self, **resources: str) -> GangBuilder:
        """Each pod requests these besides cards (``cpu="10", memory="8Gi"``)."""
        return dataclasses.replace(
            self, needs=dataclasses.replace(self.needs, requests=_resources(resources))
        )

    def tolerates(self, key: str, value: str = "", effect: str = "") -> GangBuilder:
        toleration = nodefit.Toleration(key, "Equal" if value else "Exists", value, effect)
        tolerations = (*self.needs.tolerations, toleration)
        return dataclasses.replace(
            self, needs=dataclasses.replace(self.needs, tolerations=tolerations)
        )

    def selects(self, **labels: str) -> GangBuilder:
        """A nodeSelector on each pod."""
        selector = tuple(sorted({*self.needs.node_selector, *labels.items()}))
        return dataclasses.replace(
            self, needs=dataclasses.replace(self.needs, node_selector=selector)
        )

    def requires(self, *terms: nodefit.Term) -> GangBuilder:
        """Required node affinity: one of ``terms``."""
        return dataclasses.replace(self, needs=dataclasses.replace(self.needs, affinity=terms))

    def build(self) -> model.GangRequest:
        return model.GangRequest(
            gang=model.GangKey(self.key),
            pods=tuple(
                model.PodRequest(model.PodKey(f"{self.key}-{rank}"), cards)
                for rank, cards in enumerate(self.sizes)
            ),
            priority=self.value,
            supernode=self.named,
            affinity=self.affinity,
            group_size=self.ranks_per_rack,
            spread_group=self.spread_group,
            min_pods=self.floor,
            preemptible=self.preemptible,
            needs=self.needs,
            lost_work_per_card_s=self.lost_s,
        )


@dataclass(frozen=True)
class HoldingBuilder:
    """Cards held by one pod of a gang: ``holding("ns/old").on("n1", cards=[0, 1])``."""

    gang: str
    rank: int = 0
    node: str = ""
    cards: tuple[int, ...] = ()
    value: int = 0
    spread_group: str | None = None
    requests: nodefit.Resources = ()

    def pod(self, rank: int) -> HoldingBuilder:
        return dataclasses.replace(self, rank=rank)

    def on(self, node_name: str, cards: Iterable[int]) -> HoldingBuilder:
        return dataclasses.replace(self, node=node_name, cards=tuple(cards))

    def priority(self, value: int) -> HoldingBuilder:
        return dataclasses.replace(self, value=value)

    def spread(self, group: str) -> HoldingBuilder:
        return dataclasses.replace(self, spread_group=group)

    def asking(self, **resources: str) -> HoldingBuilder:
        return dataclasses.replace(self, requests=_resources(resources))

    def build(self) -> model.Holding:
        return model.Holding(
            pod=model.PodKey(f"{self.gang}-{self.rank}"),
            gang=model.GangKey(self.gang),
            node=NodeName(self.node),
            cards=frozenset(model.CardId(c) for c in self.cards),
            priority=self.value,
            spread_group=self.spread_group,
            requests=self.requests,
        )


def _resources(resources: dict[str, str]) -> nodefit.Resources:
    return tuple(sorted((r, quantities.amount(r, q)) for r, q in resources.items()))


def node(name: str) -> NodeBuilder:
    return NodeBuilder(name)


def supernode(name: str) -> SuperNodeBuilder:
    return SuperNodeBuilder(name)


def gang(key: str) -> GangBuilder:
    return GangBuilder(key)


def holding(gang_key: str) -> HoldingBuilder:
    return HoldingBuilder(gang_key)


def cloudmatrix(name: str = "sn-a", spares: int = 1) -> SuperNodeBuilder:
    """The reference supernode: 12 racks × 4 nodes × 8 cards (two card groups of 4)."""
    return supernode(name).racks(12, nodes=4).cards(8).groups(range(4), range(4, 8)).spares(spares)
