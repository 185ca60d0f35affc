"""Assumed holdings (Kueue's ``AssumeWorkload``, Volcano's ``Statement.Commit``): every
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

A pod the operator *created* already reserved (a gang placed before its pods existed) is in
the view from its creation on, as the API server answered it, until the index shows it — or,
if the index never does (created and deleted between two passes), for
:data:`CREATED_SECONDS`; meanwhile its cards are held, never given twice.

Owned by the main loop (:mod:`matrixpool.controllers.loop`); the scheduling cycle's binding
writes it from the executor's outcomes; every read of the World applies :meth:`Assumed.view`.

Errors: none; it reads and writes memory only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from matrixpool import clock
from matrixpool.k8s import convert

log = structlog.get_logger(__name__)
CREATED_SECONDS = 60.0  # a created pod the index never showed leaves the view after this


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
    # pod UID → (its owner "<ns>/<workload>", the pod as created, when): not yet in the index
    created: dict[str, tuple[str, convert.PodFacts, float]] = field(default_factory=dict)

    def made(self, pod: convert.PodFacts) -> None:
        """The operator created ``pod`` (with its reservation, if any): seen from now on."""
        if pod.uid:
            owner = f"{pod.namespace}/{pod.owner}"
            self.created[pod.uid] = (owner, pod, clock.SYSTEM.monotonic())

    def reserved(self, pod: convert.PodFacts, node: str, cards: frozenset[int]) -> None:
        if pod.uid:
            self.holdings[pod.uid] = Assumption(pod.key, node, cards)

    def bound(self, pod: convert.PodFacts, node: str, cards: frozenset[int]) -> None:
        """``pod`` was bound to ``node``, holding ``cards``: the cards come with the call, not
        from the reservation remembered, which a read in between may have ended already
        (the index showed it) while the Binding was on its way."""
        if pod.uid:
            self.holdings[pod.uid] = Assumption(pod.key, node, cards, bound=True)

    def released(self, pod: convert.PodFacts) -> None:
        """The reservation was cleared, or could not be made: nothing to assume."""
        self.holdings.pop(pod.uid, None)

    def gone(self, pod: convert.PodFacts) -> None:
        """The API server answered that ``pod`` does not exist: it holds nothing, and what was
        assumed of it (created, reserved, bound, deleting) is dropped."""
        self.holdings.pop(pod.uid, None)
        self.created.pop(pod.uid, None)
        self.deleted.discard(pod.uid)

    def deleting(self, pod: convert.PodFacts) -> None:
        if pod.uid:
            self.deleted.add(pod.uid)

    def __len__(self) -> int:
        return len(self.holdings) + len(self.deleted) + len(self.created)

    def view(
        self, pods: Mapping[str, Sequence[convert.PodFacts]]
    ) -> dict[str, list[convert.PodFacts]]:
        """The pods as the operator left them: first drop what the index now shows (rules
        1-3 of the module), then apply the rest."""
        seen = {p.uid: p for facts in pods.values() for p in facts if p.uid}
        now = clock.SYSTEM.monotonic()
        for uid, (_, _, at) in list(self.created.items()):
            if uid in seen or now - at > CREATED_SECONDS:
                del self.created[uid]
        unseen = {uid: pod for uid, (_, pod, _) in self.created.items()}
        seen |= unseen
        for uid, assumption in list(self.holdings.items()):
            pod = seen.get(uid)
            if pod is None or assumption.shown_by(pod) or assumption.contradicted_by(pod):
                if pod is not None and assumption.contradicted_by(pod):
                    log.warning("pod bound elsewhere than assumed", pod=assumption.key)
                del self.holdings[uid]
        self.deleted = {uid for uid in self.deleted if uid in seen and not seen[uid].deleting}
        merged = {owner: list(facts) for owner, facts in pods.items()}
        for owner, pod, _ in self.created.values():
            merged.setdefault(owner, []).append(pod)
        return {owner: [self._apply(p) for p in facts] for owner, facts in merged.items()}

    def _apply(self, pod: convert.PodFacts) -> convert.PodFacts:
        assumption = self.holdings.get(pod.uid) if pod.uid else None
        if assumption is not None:
            pod = assumption.apply(pod)
        if pod.uid in self.deleted:
            pod = dataclasses.replace(pod, deleting=True)
        return pod
