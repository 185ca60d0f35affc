"""The read model: one consistent view of the cluster per pass of the main loop, built from the
kopf indexes plus what the operator itself did that the watch does not show yet.

Built by the main loop (:mod:`matrixpool.handlers.loop`); every controller (scheduling,
recovery, time-sharing, SuperNode status) reads the same :class:`World`.

**Assumed holdings** (Kueue's ``AssumeWorkload``, Volcano's ``Statement.Commit``): every
reservation, binding and deletion the operator makes is remembered by pod UID in
:class:`Assumed` until the pod index shows it, and meanwhile the pod is seen as the operator
left it. A watch that lags the loop can then never free a card, never show a reserved gang as
unplaced (its cards re-reserved for another pod) nor as half reserved (a reservation being
bound undone), and never show a victim as still running (more victims evicted for the same
gang). An assumption ends when:

1. the index shows it (the pod reserved or bound there with those cards, or terminating);
2. the index shows the pod bound elsewhere (the API decided otherwise; the index is right);
3. the pod is gone from the index (watch events are ordered, so the index has seen our write
   before it sees the deletion).

Errors: none; building the model reads memory only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from matrixpool.api import supernode
from matrixpool.handlers.workloads import Workload
from matrixpool.k8s import convert
from matrixpool.placement import inventory

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class World:
    """One consistent read of every index, with the assumed holdings applied."""

    supernodes: dict[str, supernode.SuperNode]
    nodes: list[inventory.NodeInfo]
    foreign: dict[str, dict[str, int]]  # node → resources held by pods matrixpool did not place
    pods: dict[str, list[convert.PodFacts]]  # "<ns>/<owner>" → its pods
    workloads: list[Workload]
    unreachable: frozenset[str] = frozenset()  # nodes whose checkpoint daemon does not answer
    stale: frozenset[str] = frozenset()  # nodes whose kubelet Lease is overdue


@dataclass(frozen=True)
class Assumption:
    """What the operator wrote to one pod and the index may not show yet."""

    key: str  # "<ns>/<pod>", for logs
    node: str  # the node reserved (and bound, once ``bound``)
    cards: frozenset[int]  # the cards reserved
    bound: bool = False  # the Binding was accepted

    def shown_by(self, pod: convert.PodFacts) -> bool:
        if pod.cards != self.cards:
            return False
        return pod.node == self.node if self.bound else self.node in (pod.node, pod.reserved_node)

    def contradicted_by(self, pod: convert.PodFacts) -> bool:
        return pod.node is not None and pod.node != self.node

    def apply(self, pod: convert.PodFacts) -> convert.PodFacts:
        return dataclasses.replace(
            pod,
            node=self.node if self.bound else pod.node,
            reserved_node=self.node,
            cards=self.cards,
        )


@dataclass
class Assumed:
    """Reservations, bindings and deletions made and not yet shown by the pod index, by UID.

    Owned by the main loop; the executor's outcomes feed it, :meth:`view` reads it."""

    holdings: dict[str, Assumption] = field(default_factory=dict)  # pod UID → what we wrote
    deleted: set[str] = field(default_factory=set)  # pod UIDs we deleted

    def reserved(self, pod: convert.PodFacts, node: str, cards: frozenset[int]) -> None:
        if pod.uid:
            self.holdings[pod.uid] = Assumption(pod.key, node, cards)

    def bound(self, pod: convert.PodFacts, node: str) -> None:
        if not pod.uid:
            return
        known = self.holdings.get(pod.uid)
        cards = known.cards if known is not None and known.node == node else pod.cards
        self.holdings[pod.uid] = Assumption(pod.key, node, cards, bound=True)

    def released(self, pod: convert.PodFacts) -> None:
        """The reservation was cleared, or could not be made: nothing to assume."""
        self.holdings.pop(pod.uid, None)

    def deleting(self, pod: convert.PodFacts) -> None:
        if pod.uid:
            self.deleted.add(pod.uid)

    def __len__(self) -> int:
        return len(self.holdings) + len(self.deleted)

    def view(
        self, pods: Mapping[str, Sequence[convert.PodFacts]]
    ) -> dict[str, list[convert.PodFacts]]:
        """The pods as the operator left them: first drop what the index now shows (rules
        1-3 of the module), then apply the rest."""
        seen = {p.uid: p for facts in pods.values() for p in facts if p.uid}
        for uid, assumption in list(self.holdings.items()):
            pod = seen.get(uid)
            if pod is None or assumption.shown_by(pod) or assumption.contradicted_by(pod):
                if pod is not None and assumption.contradicted_by(pod):
                    log.warning("pod bound elsewhere than assumed", pod=assumption.key)
                del self.holdings[uid]
        self.deleted = {uid for uid in self.deleted if uid in seen and not seen[uid].deleting}
        return {owner: [self._apply(p) for p in facts] for owner, facts in pods.items()}

    def _apply(self, pod: convert.PodFacts) -> convert.PodFacts:
        assumption = self.holdings.get(pod.uid) if pod.uid else None
        if assumption is not None:
            pod = assumption.apply(pod)
        if pod.uid in self.deleted:
            pod = dataclasses.replace(pod, deleting=True)
        return pod
