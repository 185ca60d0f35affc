"""From API objects to what the plugin shows: status rows, the card map, job rows and the
recovery timeline. Pure — plain dicts in (as the API returns them), frozen dataclasses out —
so it is tested without a cluster. Called by :mod:`matrixpool.kubectl.cli`; the dataclasses
are drawn by :mod:`matrixpool.kubectl.render`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from matrixpool.api import common, inferenceservice, labels, supernode, trainingjob

Obj = Mapping[str, Any]  # one API object as a plain dict
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
RESERVED_NODE = "matrixpool.dev/node"  # pod annotation: chosen node while binding is under way
NO_RACK = "-"  # rack name of nodes without a rack label


class Owner(StrEnum):
    """Who a card belongs to, in the order legends list them."""

    INFERENCE = "inference"  # held by a pod of an InferenceService
    TRAINING = "training"  # held by a pod of a TrainingJob
    SPARE = "spare"  # on a whole node held back for recovery
    UNHEALTHY = "unhealthy"  # marked in matrixpool.dev/unhealthy-cards
    FREE = "free"  # healthy, idle, allocatable
    DOWN = "down"  # on a node that is not Ready


@dataclass(frozen=True)
class Holding:
    """The cards one live gang pod holds on its node."""

    node: str  # spec.nodeName, or the reserved node while binding
    cards: frozenset[int]  # from annotation matrixpool.dev/cards
    owner: Owner  # INFERENCE or TRAINING, from label matrixpool.dev/kind


@dataclass(frozen=True)
class StatusRow:
    """One SuperNode at a glance (`status`)."""

    name: str
    inference: int  # cards held by inference pods
    training: int  # cards held by training pods
    spare: int  # status.cards.spare
    unhealthy: int  # status.cards.unhealthy (NotReady nodes included)
    free: int  # status.cards.allocatable - allocated
    nodes_ready: int
    nodes_total: int
    window: str  # time window in force, "" without time-sharing
    next_transition: str  # ISO time of the next window change, ""
    last_transition: str = ""  # the latest split change: "night 2.7s", "night (under way)", ""


@dataclass(frozen=True)
class NodeCells:
    """One node of the card map: an owner per card index."""

    name: str
    cells: tuple[Owner, ...]


@dataclass(frozen=True)
class Rack:
    """Nodes sharing a rack label, in name order."""

    name: str
    nodes: tuple[NodeCells, ...]


@dataclass(frozen=True)
class CardMap:
    """The card map of one SuperNode (`cards SN`): racks × nodes × cards."""

    supernode: str
    racks: tuple[Rack, ...]

    def counts(self) -> Counter[Owner]:
        """Cards per owner over the whole map."""
        return Counter(c for r in self.racks for n in r.nodes for c in n.cells)


@dataclass(frozen=True)
class JobRow:
    """One TrainingJob or InferenceService (`jobs`)."""

    kind: str  # TrainingJob | InferenceService
    namespace: str
    name: str
    phase: str  # TrainingJob phase; Ready / NotReady for a service
    supernodes: str  # comma-separated, "" while unplaced
    cards: int  # cards bound
    desired: int  # pods wanted now
    bound: int  # pods bound to a node
    running: int  # pods running
    autoscaled: str = ""  # a service's status.recommendation at a glance; "" without one
    kv: str = ""  # a service's KV-cache reservation: "2Gi", "waiting"; "" without spec.kvCache


@dataclass(frozen=True)
class RecoveryRow:
    """One entry of a TrainingJob's status.recoveries (`recoveries JOB`)."""

    level: str
    cause: str
    restored_step: int | None
    lost_steps: int | None
    detected_at: datetime
    recovered_at: datetime | None  # None while recovering
    id: str = ""  # the recovery id trainers see in matrixpool.dev/restore
    ranks: tuple[int, ...] = ()  # ranks restarted or moved (all of them for Reschedule)
    moves: tuple[tuple[str, str], ...] = ()  # SpareSwap: (failed node, spare node)
    rank_count: int | None = None  # how many ranks; ``ranks`` lists the lowest of them only

    @property
    def seconds(self) -> float | None:
        """How long the recovery took; None while it is under way."""
        if self.recovered_at is None:
            return None
        return (self.recovered_at - self.detected_at).total_seconds()


# --- pods and nodes -------------------------------------------------------------------------
def holdings(pods: Iterable[Obj]) -> list[Holding]:
    """The cards held by live gang pods that are bound (or being bound) to a node."""
    return [h for h in (_holding(p) for p in pods) if h is not None]


def _holding(pod: Obj) -> Holding | None:
    meta = pod.get("metadata") or {}
    pod_labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    if labels.JOB not in pod_labels or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
        return None
    node = (pod.get("spec") or {}).get("nodeName") or annotations.get(RESERVED_NODE)
    cards = labels.parse_cards(annotations.get(labels.CARDS))
    if not node or not cards:
        return None
    kind = pod_labels.get(labels.KIND)
    owner = Owner.INFERENCE if kind == inferenceservice.KIND else Owner.TRAINING
    return Holding(node=node, cards=cards, owner=owner)


def node_ready(node: Obj) -> bool:
    """The Node's Ready condition is True and it is not cordoned."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not (node.get("spec") or {}).get("unschedulable", False)


def members(sn: supernode.SuperNode, nodes: Iterable[Obj]) -> list[Obj]:
    """The Nodes a SuperNode's selector picks, in name order (an empty selector: none)."""
    selector = sn.spec.node_selector
    if selector.is_empty():
        return []
    picked = [n for n in nodes if selector.matches((n.get("metadata") or {}).get("labels") or {})]
    return sorted(picked, key=_name)


def _name(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


# --- status -----------------------------------------------------------------------------------
def status_rows(
    supernodes: Iterable[Obj], nodes: Sequence[Obj], pods: Iterable[Obj]
) -> list[StatusRow]:
    """One row per SuperNode, in name order."""
    held = holdings(pods)
    parsed = sorted((supernode.parse(s) for s in supernodes), key=lambda s: s.metadata.name)
    return [_status_row(sn, {_name(n) for n in members(sn, nodes)}, held) for sn in parsed]


def _status_row(sn: supernode.SuperNode, names: set[str], held: list[Holding]) -> StatusRow:
    used = Counter[Owner]()
    for holding in held:
        if holding.node in names:
            used[holding.owner] += len(holding.cards)
    status = sn.status
    return StatusRow(
        name=sn.metadata.name,
        inference=used[Owner.INFERENCE],
        training=used[Owner.TRAINING],
        spare=status.cards.spare,
        unhealthy=status.cards.unhealthy,
        free=max(0, status.cards.allocatable - status.cards.allocated),
        nodes_ready=status.nodes.ready,
        nodes_total=status.nodes.total,
        window=status.window or "",
        next_transition=status.next_transition.isoformat() if status.next_transition else "",
        last_transition=_last_transition(status.transition),
    )


def _last_transition(move: supernode.Transition | None) -> str:
    """The latest transition in a few words: its window and how long it took."""
    if move is None:
        return ""
    window = move.window or "-"
    if move.settled_at is None or move.seconds is None:
        return f"{window} (under way)"
    return f"{window} {move.seconds:.1f}s"


# --- the card map -------------------------------------------------------------------------------
def card_map(sn_body: Obj, nodes: Sequence[Obj], pods: Iterable[Obj]) -> CardMap:
    """Every card of a SuperNode's member nodes with its owner, grouped by rack."""
    sn = supernode.parse(sn_body)
    by_node: dict[str, dict[int, Owner]] = {}
    for holding in holdings(pods):
        by_node.setdefault(holding.node, {}).update(dict.fromkeys(holding.cards, holding.owner))
    racks: dict[str, list[NodeCells]] = {}
    spares = set(sn.status.spare_nodes)
    for node in members(sn, nodes):
        cells = node_cells(sn, node, by_node.get(_name(node), {}), _name(node) in spares)
        racks.setdefault(_rack(node), []).append(cells)
    return CardMap(
        supernode=sn.metadata.name,
        racks=tuple(Rack(name, tuple(racks[name])) for name in sorted(racks, key=natural)),
    )


def node_cells(
    sn: supernode.SuperNode, node: Obj, held: Mapping[int, Owner], spare: bool
) -> NodeCells:
    """Owners of one node's cards: down > unhealthy > held > spare > free."""
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    unhealthy = labels.parse_cards(annotations.get(labels.UNHEALTHY_CARDS))
    ready = node_ready(node)

    def owner(card: int) -> Owner:
        if not ready:
            return Owner.DOWN
        if card in unhealthy:
            return Owner.UNHEALTHY
        return held.get(card) or (Owner.SPARE if spare else Owner.FREE)

    count = _card_count(sn, node)
    return NodeCells(name=_name(node), cells=tuple(owner(c) for c in range(count)))


def _card_count(sn: supernode.SuperNode, node: Obj) -> int:
    """Allocatable cards of the node's card resource; spec.cardsPerNode when not reported."""
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    try:
        return int(str(allocatable[sn.spec.card_resource]))
    except (KeyError, ValueError):
        return sn.spec.cards_per_node


def natural(name: str) -> tuple[str | int, ...]:
    """Sort key that puts ``rack-2`` before ``rack-10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _rack(node: Obj) -> str:
    return str(((node.get("metadata") or {}).get("labels") or {}).get(labels.RACK, NO_RACK))


# --- jobs ---------------------------------------------------------------------------------------
def job_rows(
    training: Iterable[Obj], inference: Iterable[Obj], pods: Iterable[Obj]
) -> list[JobRow]:
    """TrainingJobs then InferenceServices, each by namespace and name."""
    pods = list(pods)
    rows = [_training_row(j) for j in training] + [_inference_row(s, pods) for s in inference]
    order = {trainingjob.KIND: 0, inferenceservice.KIND: 1}
    return sorted(rows, key=lambda r: (order.get(r.kind, 2), r.namespace, r.name))


def _training_row(body: Obj) -> JobRow:
    job = trainingjob.parse(body)
    status = job.status
    return JobRow(
        kind=trainingjob.KIND,
        namespace=job.metadata.namespace or "",
        name=job.metadata.name,
        phase=str(status.phase),
        supernodes=_supernodes(status.placement),
        cards=status.placement.cards,
        desired=status.replicas.desired,
        bound=status.replicas.bound,
        running=status.replicas.running,
    )


def _inference_row(body: Obj, pods: list[Obj]) -> JobRow:
    service = inferenceservice.parse(body)
    status = service.status
    namespace = service.metadata.namespace or ""
    own = [p for p in pods if _owned_by(p, inferenceservice.KIND, namespace, service.metadata.name)]
    ready = next((c for c in status.conditions if c.type == "Ready"), None)
    return JobRow(
        kind=inferenceservice.KIND,
        namespace=namespace,
        name=service.metadata.name,
        phase="Ready" if ready is not None and ready.status == "True" else "NotReady",
        supernodes=_supernodes(status.placement),
        cards=status.placement.cards,
        desired=_desired_pods(service),
        bound=sum(1 for p in own if (p.get("spec") or {}).get("nodeName")),
        running=sum(1 for p in own if (p.get("status") or {}).get("phase") == "Running"),
        autoscaled=_autoscaled(status.recommendation),
        kv=_kv(status.kv_cache),
    )


def _kv(kv: inferenceservice.KvCacheStatus | None) -> str:
    """The bytes reserved in the KV-cache pool, or ``waiting``."""
    if kv is None:
        return ""
    return (kv.reserved or "") if kv.admitted else "waiting"


def _autoscaled(advice: inferenceservice.Recommendation | None) -> str:
    """``"prefill 3, decode 1"``; ``(advice)`` after it in Advisory mode."""
    if advice is None or not advice.summary:
        return ""
    advisory = advice.mode == inferenceservice.AutoscalingMode.ADVISORY
    return f"{advice.summary} (advice)" if advisory else advice.summary


def _desired_pods(service: inferenceservice.InferenceService) -> int:
    """Pods wanted now: instances per role (status, scaled by the window; else spec) × pods."""
    wanted = {r.name: r.replicas for r in service.status.roles}
    return sum(wanted.get(r.name, r.replicas) * r.pods_per_replica for r in service.spec.roles)


def _owned_by(pod: Obj, kind: str, namespace: str, name: str) -> bool:
    meta = pod.get("metadata") or {}
    pod_labels = meta.get("labels") or {}
    return (
        meta.get("namespace", "") == namespace
        and pod_labels.get(labels.JOB) == name
        and pod_labels.get(labels.KIND) == kind
    )


def _supernodes(placement: common.PlacementStatus) -> str:
    names = list(placement.super_nodes) or ([placement.super_node] if placement.super_node else [])
    return ",".join(names)


# --- recoveries -----------------------------------------------------------------------------------
def recovery_rows(job_body: Obj) -> list[RecoveryRow]:
    """A TrainingJob's recoveries, oldest first, with the one under way (status.recovering)
    last, its recovered time empty."""
    status = trainingjob.parse(job_body).status
    records: list[trainingjob.RecoveryRecord] = list(status.recoveries)
    ongoing = status.recovering
    if ongoing is not None and not any(r.id and r.id == ongoing.id for r in records):
        records.append(ongoing.model_copy(update={"recovered_at": None}))
    rows = [
        RecoveryRow(
            level=str(r.level),
            cause=r.cause,
            restored_step=r.restored_step,
            lost_steps=r.lost_steps,
            detected_at=r.detected_at,
            recovered_at=r.recovered_at,
            id=r.id,
            ranks=tuple(r.ranks),
            rank_count=r.rank_count,
            moves=tuple(sorted(r.moves.items())),
        )
        for r in records
    ]
    return sorted(rows, key=lambda r: r.detected_at)
