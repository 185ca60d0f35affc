"""What a pod asks of a node besides cards, and whether a node gives it: resources, taints and
tolerations, ``nodeSelector`` and required node affinity (kube-scheduler's filters).

Pure (no kopf, no Kubernetes client). :mod:`matrixpool.placement.gangs` reads a gang's
:class:`Needs` from its pod template, :mod:`matrixpool.k8s.convert` reads nodes' taints and
pods' requests with the same functions, and :class:`matrixpool.placement.snapshot.Layout`
applies the filters once per distinct :class:`Needs` and cycle.

Rules (as kube-scheduler applies them):

- a pod's request of a resource is the sum over its containers (a container's limit when it
  sets no request), at least the largest init container's (sidecar init containers, with
  ``restartPolicy: Always``, add to what runs after them), plus ``spec.overhead``;
- a node takes the pod when every requested resource is at least as large in its allocatable
  less the requests of every pod already there (a resource the node does not list is 0);
- taints with effect ``NoSchedule`` or ``NoExecute`` keep out pods without a matching
  toleration (``PreferNoSchedule`` is a preference and is ignored);
- ``nodeSelector`` labels must all match, and one of the required node affinity terms
  (``matchExpressions`` In/NotIn/Exists/DoesNotExist/Gt/Lt and ``matchFields`` on
  ``metadata.name``, ANDed in a term) must match; an empty term matches no node.

Left out: the node's ``pods`` count, preferred (soft) affinity, pod (anti-)affinity and
topology spread constraints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matrixpool.placement import quantities

Resources = tuple[tuple[str, int], ...]  # sorted (resource, amount): cpu in millicores
BLOCKING = frozenset({"NoSchedule", "NoExecute"})  # taint effects that keep pods out
NODE_NAME_FIELD = "metadata.name"  # the one field matchFields may name

SELECTOR_MISMATCH = "didn't match nodeSelector"
AFFINITY_MISMATCH = "didn't match required node affinity"


@dataclass(frozen=True)
class Taint:
    """One ``spec.taints`` entry of a Node."""

    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __str__(self) -> str:
        return (
            f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"
        )


@dataclass(frozen=True)
class Toleration:
    """One ``tolerations`` entry of a pod spec."""

    key: str = ""  # "" with Exists: every key
    operator: str = "Equal"  # Equal | Exists
    value: str = ""
    effect: str = ""  # "": every effect

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


@dataclass(frozen=True)
class Requirement:
    """One ``matchExpressions`` (or ``matchFields``) entry of a node selector term."""

    key: str
    operator: str  # In | NotIn | Exists | DoesNotExist | Gt | Lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        op = self.operator
        if op in ("In", "NotIn"):
            inside = present and labels[self.key] in self.values
            return inside if op == "In" else not inside
        if op in ("Exists", "DoesNotExist"):
            return present == (op == "Exists")
        if op in ("Gt", "Lt") and present and len(self.values) == 1:
            try:
                have, bound = int(labels[self.key]), int(self.values[0])
            except ValueError:
                return False
            return have > bound if op == "Gt" else have < bound
        return False


@dataclass(frozen=True)
class Term:
    """One ``nodeSelectorTerms`` entry: every expression and field requirement holds."""

    expressions: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()

    def matches(self, name: str, labels: Mapping[str, str]) -> bool:
        if not self.expressions and not self.fields:
            return False
        names = {NODE_NAME_FIELD: name}
        return all(r.matches(labels) for r in self.expressions) and all(
            r.matches(names) for r in self.fields
        )


@dataclass(frozen=True)
class Needs:
    """What every pod of a gang asks of its node besides cards (hashable: the layout keeps one
    filter result per distinct value)."""

    requests: Resources = ()  # without the card resource
    tolerations: tuple[Toleration, ...] = ()
    node_selector: tuple[tuple[str, str], ...] = ()
    affinity: tuple[Term, ...] | None = None  # required terms, ORed; None: no requirement

    def mismatch(self, name: str, labels: Mapping[str, str], taints: Iterable[Taint]) -> str | None:
        """Why the node never takes such a pod (selector, affinity, taint), or None."""
        if any(labels.get(k) != v for k, v in self.node_selector):
            return SELECTOR_MISMATCH
        if self.affinity is not None and not any(t.matches(name, labels) for t in self.affinity):
            return AFFINITY_MISMATCH
        for taint in taints:
            if taint.effect in BLOCKING and not any(t.tolerates(taint) for t in self.tolerations):
                return f"had untolerated taint {taint}"
        return None


NO_NEEDS = Needs()


def short(requests: Resources, room: Mapping[str, int], used: Mapping[str, int]) -> list[str]:
    """The resources of which ``room`` less ``used`` holds less than ``requests``."""
    return [r for r, a in requests if a > 0 and room.get(r, 0) - used.get(r, 0) < a]


def describe(requests: Resources) -> str:
    """``cpu 2, memory 4Gi`` for a reason message."""
    return ", ".join(f"{r} {quantities.show(r, a)}" for r, a in requests)


# ---- reading the wire form (dicts as the API and the CRDs carry them) ----------------------


def needs_of(template: Mapping[str, Any], card_resource: str = "") -> Needs:
    """The needs of a pod made from ``template`` (a PodTemplateSpec), less the card resource
    (the operator sets that one itself)."""
    spec = template.get("spec") or {}
    requests = pod_requests(spec)
    requests.pop(card_resource, None)
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    return Needs(
        requests=tuple(sorted((r, a) for r, a in requests.items() if a > 0)),
        tolerations=tuple(_toleration(t) for t in spec.get("tolerations") or ()),
        node_selector=tuple(
            sorted((str(k), str(v)) for k, v in (spec.get("nodeSelector") or {}).items())
        ),
        affinity=None if required is None else _terms(required.get("nodeSelectorTerms") or ()),
    )


def pod_requests(spec: Mapping[str, Any]) -> dict[str, int]:
    """What a pod spec requests of its node (the rules of the module doc), by resource."""
    total: dict[str, int] = {}
    for container in spec.get("containers") or ():
        _add(total, _container(container))
    init_peak: dict[str, int] = {}
    sidecars: dict[str, int] = {}
    for container in spec.get("initContainers") or ():
        own = _container(container)
        if container.get("restartPolicy") == "Always":
            _add(total, own)
            _add(sidecars, own)
            running = dict(sidecars)
        else:
            running = dict(sidecars)
            _add(running, own)
        for r, a in running.items():
            init_peak[r] = max(init_peak.get(r, 0), a)
    for r, a in init_peak.items():
        total[r] = max(total.get(r, 0), a)
    _add(total, quantities.amounts(spec.get("overhead") or {}))
    return total


def taints_of(items: Sequence[Mapping[str, Any]]) -> tuple[Taint, ...]:
    """A Node's ``spec.taints``."""
    return tuple(
        Taint(str(t.get("key", "")), str(t.get("value") or ""), str(t.get("effect", "")))
        for t in items
    )


def _container(container: Mapping[str, Any]) -> dict[str, int]:
    resources = container.get("resources") or {}
    limits = quantities.amounts(resources.get("limits") or {})
    return {**limits, **quantities.amounts(resources.get("requests") or {})}


def _add(into: dict[str, int], more: Mapping[str, int]) -> None:
    for r, a in more.items():
        into[r] = into.get(r, 0) + a


def _toleration(item: Mapping[str, Any]) -> Toleration:
    return Toleration(
        key=str(item.get("key") or ""),
        operator=str(item.get("operator") or "Equal"),
        value=str(item.get("value") or ""),
        effect=str(item.get("effect") or ""),
    )


def _terms(items: Iterable[Mapping[str, Any]]) -> tuple[Term, ...]:
    return tuple(
        Term(
            expressions=_requirements(term.get("matchExpressions") or ()),
            fields=_requirements(term.get("matchFields") or ()),
        )
        for term in items
    )


def _requirements(items: Iterable[Mapping[str, Any]]) -> tuple[Requirement, ...]:
    return tuple(
        Requirement(str(e["key"]), str(e["operator"]), tuple(str(v) for v in e.get("values") or ()))
        for e in items
    )
