"""Conversions from raw API objects (dicts as kopf delivers them) to the pure records of
:mod:`matrixpool.placement.inventory`. Called by the kopf indexes (:mod:`matrixpool.state.indexes`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from matrixpool.api import labels as names
from matrixpool.placement import inventory, nodefit, quantities

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
NODE_ANNOTATION = "matrixpool.dev/node"  # a reserved pod's node while it is being bound


def node_info(
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
) -> inventory.NodeInfo:
    """A Node as the inventory sees it: Ready and schedulable, its extended resources (cards),
    the card indices a device plugin or a person marked unhealthy, and what placement checks
    besides cards (allocatable resources, taints, cordon)."""
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    unhealthy, _ = inventory.parse_card_list(annotations.get(names.UNHEALTHY_CARDS))
    cordoned = bool(spec.get("unschedulable", False))
    allocatable = status.get("allocatable") or {}
    return inventory.NodeInfo(
        name=inventory.NodeName(name),
        labels=dict(labels),
        ready=ready and not cordoned,
        cards=extended_resources(allocatable),
        unhealthy=unhealthy,
        down=not ready,
        allocatable=quantities.amounts(allocatable),
        taints=nodefit.taints_of(spec.get("taints") or ()),
        cordoned=cordoned,
        address=next(
            (
                str(a.get("address", ""))
                for a in status.get("addresses") or []
                if a.get("type") == "InternalIP"
            ),
            "",
        ),
    )


def extended_resources(resources: Mapping[str, Any]) -> dict[str, int]:
    """The ``domain/name`` resources of a resource list, as whole numbers."""
    counts: dict[str, int] = {}
    for key, value in resources.items():
        if "/" in key:
            try:
                counts[key] = int(str(value))
            except ValueError:
                continue
    return counts


def foreign_requests(
    spec: Mapping[str, Any], status: Mapping[str, Any], labels: Mapping[str, str]
) -> dict[str, int] | None:
    """What a bound, live pod that matrixpool did not place requests of its node (cpu in
    millicores, memory, a device plugin's cards...; :func:`nodefit.pod_requests`), or None if
    it requests nothing."""
    if names.JOB in labels:
        return None
    if not spec.get("nodeName") or status.get("phase") in TERMINAL_PHASES:
        return None
    return nodefit.pod_requests(spec) or None


PodRef = tuple[str, str, str]  # namespace, name, UID ("": whichever pod has the name)


@dataclass(frozen=True)
class PodFacts:
    """A pod of a matrixpool gang, as the scheduler cycle needs it."""

    namespace: str
    name: str
    owner: str  # value of the matrixpool.dev/job label
    kind: str  # TrainingJob | InferenceService
    role: str  # matrixpool.dev/role: "trainer", or the inference role
    replica: int  # matrixpool.dev/replica
    rank: int  # matrixpool.dev/rank
    node: str | None  # spec.nodeName once bound
    reserved_node: str | None  # annotation matrixpool.dev/node: chosen, binding in progress
    cards: frozenset[int]  # annotation matrixpool.dev/cards
    phase: str
    deleting: bool
    ready: bool
    restore: str = ""  # annotation matrixpool.dev/restore: what the rank restored from
    incarnation: int = 0  # annotation matrixpool.dev/incarnation: the run it started as
    uid: str = ""  # metadata.uid: the pod's identity (a re-created pod is another pod)
    released: bool = False  # its job Succeeded: kept for its logs, its cards free (read model)
    requests: nodefit.Resources = ()  # what it requests of its node (cards included)
    ip: str = ""  # status.podIP: where an inference pod serves its /metrics (autoscaler)
    world: int = 0  # env MATRIXPOOL_WORLD_SIZE of a training pod: the gang it was made for
    gone_by: float = 0.0  # metadata.deletionTimestamp (epoch s): when its grace ends; 0: none

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def ref(self) -> PodRef:
        """(namespace, name, UID): this very pod, not a later one of the same name."""
        return (self.namespace, self.name, self.uid)

    @property
    def holds_cards(self) -> bool:
        """Cards are held from the reservation on. A pod that Succeeded holds its cards until
        every rank of its job has (a rank restarted in place gets them back), then none
        (``released``, set by :class:`matrixpool.state.world.World`)."""
        return bool(self.cards) and bool(self.node or self.reserved_node) and not self.released


def pod_facts(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    meta: Mapping[str, Any],
) -> PodFacts | None:
    """The facts of a matrixpool pod, or None for other pods."""
    owner = labels.get(names.JOB)
    if not owner:
        return None
    cards, _ = inventory.parse_card_list(annotations.get(names.CARDS))
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    return PodFacts(
        namespace=namespace,
        name=name,
        owner=owner,
        kind=labels.get(names.KIND, ""),
        role=labels.get(names.ROLE, ""),
        replica=_number(labels.get(names.REPLICA)),
        rank=_number(labels.get(names.RANK)),
        node=spec.get("nodeName"),
        reserved_node=annotations.get(NODE_ANNOTATION),
        cards=cards,
        phase=status.get("phase") or "Pending",
        deleting=bool(meta.get("deletionTimestamp")),
        gone_by=_epoch(meta.get("deletionTimestamp")),
        ready=ready,
        restore=annotations.get(names.RESTORE, ""),
        incarnation=_number(annotations.get(names.INCARNATION)),
        uid=str(meta.get("uid") or ""),
        requests=tuple(sorted(nodefit.pod_requests(spec).items())),
        ip=str(status.get("podIP") or ""),
        world=world_of(spec),
    )


def world_of(spec: Mapping[str, Any]) -> int:
    """The world size a training pod was created for (its containers' ``MATRIXPOOL_WORLD_SIZE``,
    what its trainer reads; 0 when none says)."""
    for container in spec.get("containers") or []:
        for variable in container.get("env") or []:
            if variable.get("name") == names.ENV_WORLD_SIZE:
                return _number(str(variable.get("value") or ""))
    return 0


def _number(text: str | None) -> int:
    return int(text) if text and text.isdigit() else 0


def _epoch(stamp: Any) -> float:
    """An RFC 3339 time as epoch seconds; 0.0 for none or one that does not parse."""
    if not stamp:
        return 0.0
    try:
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
