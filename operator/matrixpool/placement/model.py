"""The vocabulary of gang placement: the static topology, the requests, and the answers.

Pure (no kopf, no Kubernetes client). The controllers (``matrixpool.controllers``) build a
:class:`Topology` from SuperNodes and Nodes, a snapshot of what is held from bound Pods, and
:class:`GangRequest` objects from TrainingJobs and InferenceServices; the engine
(:mod:`matrixpool.placement.engine`) answers with a :class:`Placement`, a :class:`Preemption`
or an :class:`Unplaceable` carrying reasons — "does not fit" is data, not an exception.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

from matrixpool.placement import nodefit
from matrixpool.placement.inventory import NodeName

CardId = NewType("CardId", int)  # index of a card on its node, 0..cards-1
GangKey = NewType("GangKey", str)  # "<namespace>/<job>" or "<namespace>/<service>/<role>/<replica>"
PodKey = NewType("PodKey", str)  # "<namespace>/<pod name>"


class Affinity(enum.StrEnum):
    """How strictly a gang keeps to one supernode (spec.placement.superNodeAffinity)."""

    REQUIRED = "Required"  # one supernode, the one named if any
    PREFERRED = "Preferred"  # the fewest supernodes, whole nodes first


@dataclass(frozen=True)
class NodeSlot:
    """One node as placement sees it: where it sits and which cards it can offer."""

    name: NodeName
    supernode: str
    domains: tuple[str, ...]  # values of the supernode's topologyKeys, coarse → fine (racks)
    cards: int  # cards on the node (allocatable of the card resource)
    card_groups: tuple[tuple[CardId, ...], ...] = ()  # intra-node link groups; () = one group
    usable: frozenset[CardId] | None = None  # healthy cards of a Ready node; None = all cards
    labels: tuple[tuple[str, str], ...] = ()  # the Node's labels, for nodeSelector and affinity
    taints: tuple[nodefit.Taint, ...] = ()  # the Node's spec.taints
    room: nodefit.Resources | None = None  # allocatable less foreign pods' requests; None: any
    cordoned: bool = False  # spec.unschedulable: no new pods (its usable cards are then empty)


@dataclass(frozen=True)
class SuperNodeTopology:
    """The static tree of one supernode (nodes sorted by domains, then name)."""

    name: str
    card_resource: str
    nodes: tuple[NodeSlot, ...]
    spares: int = 0  # whole nodes held back for recovery, never used for normal placement


@dataclass(frozen=True)
class Holding:
    """Cards a bound (or being-bound) pod holds; rebuilt from the API at every start."""

    pod: PodKey
    gang: GangKey
    node: NodeName
    cards: frozenset[CardId]
    priority: int
    spread_group: str | None = None  # the pod's GangRequest.spread_group (inference role)
    requests: nodefit.Resources = ()  # what the pod requests of its node besides cards
    leaving: bool = False  # the pod is going away (deleting, or its workload is gone)


@dataclass(frozen=True)
class PodRequest:
    """One pod of a gang, in rank order."""

    pod: PodKey
    cards: int  # cards on one node; never more than the node has


@dataclass(frozen=True)
class GangRequest:
    """All pods that must be placed together, or not at all."""

    gang: GangKey
    pods: tuple[PodRequest, ...]
    priority: int
    supernode: str | None = None  # None: any supernode that fits
    affinity: Affinity = Affinity.REQUIRED
    group_size: int | None = None  # consecutive ranks that must share one topology domain
    spread_group: str | None = None  # replicas of one inference role: spread across racks
    min_pods: int | None = None  # elastic floor: may shrink to this many pods (drop high ranks)
    preemptible: bool = True  # may lose cards to strictly higher priorities
    cards_field: str = "spec.cardsPerReplica"  # spec field of the pod cards, named in reasons
    needs: nodefit.Needs = nodefit.NO_NEEDS  # what each pod asks of its node besides cards
    # seconds of work each of its cards loses if it stops now (since its last committed
    # checkpoint, or since it started); the controller computes it from its clock
    lost_work_per_card_s: float = 0.0


@dataclass(frozen=True)
class Assignment:
    """Where one pod goes."""

    pod: PodKey
    node: NodeName
    cards: tuple[CardId, ...]
    supernode: str = ""  # the node's supernode ("" when the engine did not say)


@dataclass(frozen=True)
class Placement:
    """A whole gang placed: one assignment per pod, in rank order."""

    gang: GangKey
    assignments: tuple[Assignment, ...]
    priority: int = 0  # the gang's priority, recorded with its holdings on commit
    spread_group: str | None = None  # the gang's spread group, recorded on commit
    requests: nodefit.Resources = ()  # each pod's requests besides cards, recorded on commit

    @property
    def supernodes(self) -> tuple[str, ...]:
        return tuple(sorted({a.supernode for a in self.assignments}))


@dataclass(frozen=True)
class Reason:
    """Why a gang does not fit: a CamelCase code for conditions and Events, and a sentence."""

    code: str  # e.g. UnknownSuperNode, InsufficientCards, NodeTooSmall, InsufficientResources
    message: str


@dataclass(frozen=True)
class Unplaceable:
    """The gang does not fit now (or ever, when ``permanent``)."""

    gang: GangKey
    reasons: tuple[Reason, ...]
    permanent: bool = False  # the spec can never be served on this topology


@dataclass(frozen=True)
class Preemption:
    """Make room for ``placement`` by shrinking and evicting lower-priority gangs first."""

    placement: Placement
    shrink: dict[GangKey, int] = field(default_factory=dict)  # gang → pods it keeps
    evict: tuple[GangKey, ...] = ()  # whole gangs to evict (after checkpointing)
