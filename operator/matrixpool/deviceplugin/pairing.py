"""Which pod a device request is for: the pure pairing of the kubelet's GetPreferredAllocation
and Allocate calls with the pod the operator placed on this node, and its cards.

The kubelet never says which pod it admits. It admits the pods bound to its node one at a
time, oldest first, and for each container asks the plugin for N devices. So the request for
N cards is paired with the oldest pod bound to the node that still waits for its cards: phase
Pending, not yet allocated by this plugin (annotation :data:`ALLOCATED`, or the plugin's own
memory of an Allocate whose patch has not shown yet), asking N cards of the plugin's resource
and annotated with N cards (``matrixpool.dev/cards``) that are all free. (The operator gives a
pod all its cards in its first container; a pod that spreads its cards over several containers
is never paired and gets the kubelet's choice.)

Called by :mod:`matrixpool.deviceplugin.service` under its lock; the pods come from
:mod:`matrixpool.deviceplugin.kube` (or a test's fake) through :func:`pod_from_manifest`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from matrixpool.api import labels

# Pod annotation written by the plugin once it has allocated a pod's cards: the cards it gave,
# in the format of matrixpool.dev/cards. Deliberately outside the matrixpool.dev/ prefix: the
# chart's ValidatingAdmissionPolicy lets only the operator write matrixpool.dev/* on pods, and
# this record is the plugin's, not the operator's. Writing it can never move a pod onto other
# cards; at worst (a user removing or adding it) a pod is paired by the kubelet's choice.
ALLOCATED = "deviceplugin.matrixpool.dev/allocated-cards"

TERMINAL = frozenset({"Succeeded", "Failed"})  # pod phases whose containers hold no device

# Why an Allocate got the cards it got (logged with every allocation).
Reason = Literal["preferred", "annotation", "taken", "unpaired"]


@dataclass(frozen=True)
class Pod:
    """What pairing needs of a pod bound to this node."""

    uid: str  # metadata.uid: the pod's identity
    namespace: str  # metadata.namespace
    name: str  # metadata.name
    created: str  # metadata.creationTimestamp, RFC 3339 in UTC: sorts as the time does
    phase: str  # status.phase; "" before the kubelet has written one
    requested: int  # cards of the plugin's resource its containers ask for (limits)
    cards: frozenset[int] | None  # its matrixpool.dev/cards; None: absent or unreadable
    allocated: frozenset[int] | None  # its ALLOCATED annotation; None: absent

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Allocation:
    """The answer to one container's Allocate."""

    cards: frozenset[int]  # the cards the container gets (its *_VISIBLE_DEVICES)
    pod: Pod | None  # the pod it was paired with; None: not a pod matrixpool placed
    reason: Reason  # how the cards were chosen


def pod_from_manifest(manifest: Mapping[str, Any], resource: str) -> Pod:
    """A pod as the API returns it (JSON, camelCase) → :class:`Pod` for ``resource``."""
    metadata = manifest.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    return Pod(
        uid=str(metadata.get("uid") or ""),
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        created=str(metadata.get("creationTimestamp") or ""),
        phase=str((manifest.get("status") or {}).get("phase") or ""),
        requested=_requested(manifest.get("spec") or {}, resource),
        cards=_cards(annotations.get(labels.CARDS)),
        allocated=_allocated(annotations),
    )


def _requested(spec: Mapping[str, Any], resource: str) -> int:
    total = 0
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        amount = (resources.get("limits") or {}).get(resource) or (
            resources.get("requests") or {}
        ).get(resource)
        try:
            total += int(amount or 0)
        except (TypeError, ValueError):
            continue  # not a whole number of cards: the API server would not have taken it
    return total


def _cards(value: object) -> frozenset[int] | None:
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return labels.parse_cards(value)
    except ValueError:
        return None


def _allocated(annotations: Mapping[str, Any]) -> frozenset[int] | None:
    if ALLOCATED not in annotations:
        return None
    # Present but unreadable still means allocated: such a pod must never be paired again.
    return _cards(annotations[ALLOCATED]) or frozenset()


def held(pods: Iterable[Pod], remembered: Mapping[str, frozenset[int]]) -> frozenset[int]:
    """Cards in use on the node as the plugin knows it: what it gave pods that still run (its
    memory first, then their ALLOCATED annotation), and the matrixpool cards of pods past
    Pending without its mark (started before the plugin ran, or paired by the kubelet's ids)."""
    cards: set[int] = set()
    for pod in pods:
        if pod.phase in TERMINAL:
            continue
        if pod.uid in remembered:
            cards |= remembered[pod.uid]
        elif pod.allocated is not None:
            cards |= pod.allocated
        elif pod.phase != "Pending" and pod.requested and pod.cards:
            cards |= pod.cards
    return frozenset(cards)


def waiting(pods: Iterable[Pod], size: int, remembered: Mapping[str, frozenset[int]]) -> list[Pod]:
    """Pods that wait for ``size`` cards of the operator's choosing, oldest first."""
    found = [
        pod
        for pod in pods
        if pod.phase in ("", "Pending")
        and pod.allocated is None
        and pod.uid not in remembered
        and pod.requested == size
        and pod.cards is not None
        and len(pod.cards) == size
    ]
    return sorted(found, key=lambda pod: (pod.created, pod.namespace, pod.name))


def preferred(
    pods: Iterable[Pod],
    size: int,
    available: frozenset[int],
    must_include: frozenset[int],
    remembered: Mapping[str, frozenset[int]],
) -> Pod | None:
    """GetPreferredAllocation: the oldest waiting pod whose cards the kubelet can give."""
    for pod in waiting(pods, size, remembered):
        assert pod.cards is not None  # waiting() keeps only annotated pods
        if pod.cards <= available and must_include <= pod.cards:
            return pod
    return None


def kubelet_order(available: frozenset[int], must_include: frozenset[int], size: int) -> list[int]:
    """The preferred allocation for a pod matrixpool did not place: the cards the kubelet must
    include, then the lowest-numbered available ones."""
    rest = sorted(available - must_include)
    return sorted(must_include) + rest[: max(0, size - len(must_include))]


def allocate(
    pods: Iterable[Pod],
    ids: frozenset[int],
    free: frozenset[int],
    remembered: Mapping[str, frozenset[int]],
) -> Allocation:
    """Allocate: the cards one container gets for the kubelet's ``ids``.

    1. A waiting pod annotated with exactly ``ids`` (the kubelet followed the preferred
       allocation, the usual case): those cards.
    2. Else the oldest waiting pod of that size whose annotated cards are all ``free`` (not
       held, healthy): its annotated cards, not the kubelet's. The kubelet's own accounting
       then differs from what the container sees (it counts ``ids`` as used), but the operator
       placed every other pod of the node by the annotation too, so the container gets the
       cards no one else is given; the plugin's ledger (:func:`held`) counts what it gave.
    3. Else a waiting pod of that size whose cards are taken: the kubelet's ``ids``, so that
       no card is given twice; the pod is still marked, so that it is not paired again.
    4. No waiting pod of that size (a pod matrixpool did not place): the kubelet's ``ids``.
    """
    candidates = waiting(pods, len(ids), remembered)
    for pod in candidates:
        if pod.cards == ids:
            return Allocation(cards=ids, pod=pod, reason="preferred")
    for pod in candidates:
        assert pod.cards is not None  # waiting() keeps only annotated pods
        if pod.cards <= free:
            return Allocation(cards=pod.cards, pod=pod, reason="annotation")
    if candidates:
        return Allocation(cards=ids, pod=candidates[0], reason="taken")
    return Allocation(cards=ids, pod=None, reason="unpaired")
