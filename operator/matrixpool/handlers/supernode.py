"""SuperNode handlers: pool the cards of the member Nodes and keep ``status`` current.

kopf indexes hold the facts (Nodes, card-holding Pods, every SuperNode's selector); one daemon per
SuperNode recomputes its status from them every :data:`SYNC_SECONDS` and patches only what
changed. Because the indexes are rebuilt from the API before any daemon starts, an operator
killed at any moment converges to the same status when it comes back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import pydantic
import structlog

from matrixpool import api, clock
from matrixpool.api import common, supernode
from matrixpool.k8s import convert
from matrixpool.k8s import status as k8s_status
from matrixpool.placement import inventory

GROUP, VERSION, PLURAL = api.GROUP, api.VERSION, supernode.PLURAL
SYNC_SECONDS = 1.0

log = structlog.get_logger(__name__)


@kopf.index("", "v1", "nodes")
def node_facts(
    name: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    **_: Any,
) -> dict[str, inventory.NodeInfo]:
    return {name: convert.node_info(name, labels, annotations, spec, status)}


@kopf.index("", "v1", "pods")
def pod_cards(
    spec: Mapping[str, Any], status: Mapping[str, Any], **_: Any
) -> dict[str, dict[str, int]] | None:
    held = convert.pod_cards(spec, status)
    return {spec["nodeName"]: held} if held else None


@kopf.index(GROUP, VERSION, PLURAL)
def supernode_selectors(
    name: str, spec: Mapping[str, Any], **_: Any
) -> dict[str, inventory.Selector]:
    return {name: inventory.Selector.from_spec(spec.get("nodeSelector"))}


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5)  # type: ignore[arg-type]
async def keep_status(
    name: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    node_facts: kopf.Index[str, inventory.NodeInfo],
    pod_cards: kopf.Index[str, dict[str, int]],
    supernode_selectors: kopf.Index[str, inventory.Selector],
    **_: Any,
) -> None:
    last: Mapping[str, Any] | None = None
    while not stopped:
        facts = Facts.collect(node_facts, pod_cards, supernode_selectors)
        current = common.plain(body.get("status") or {})
        try:
            desired = desired_status(name, body, facts)
        except pydantic.ValidationError as error:  # only if the CRD and the model disagree
            log.error("supernode spec does not parse", supernode=name, error=str(error))
            await stopped.wait(SYNC_SECONDS * 10)
            continue
        if desired != last and _differs(desired, current):
            await k8s_status.patch_cluster_status(PLURAL, name, desired)
            _announce(body, current, desired)
            last = desired
        await stopped.wait(SYNC_SECONDS)


@dataclass(frozen=True)
class Facts:
    """One consistent read of the indexes."""

    nodes: list[inventory.NodeInfo]
    held: dict[str, dict[str, int]]  # node name → extended resources held by live pods
    selectors: dict[str, inventory.Selector]  # supernode name → selector

    @classmethod
    def collect(
        cls,
        nodes: kopf.Index[str, inventory.NodeInfo],
        pods: kopf.Index[str, dict[str, int]],
        selectors: kopf.Index[str, inventory.Selector],
    ) -> Facts:
        held: dict[str, dict[str, int]] = {}
        for node, store in pods.items():
            for resources in store:
                for key, count in resources.items():
                    held.setdefault(node, {})[key] = held.setdefault(node, {}).get(key, 0) + count
        return cls(
            nodes=[info for store in nodes.values() for info in store],
            held=held,
            selectors={name: next(iter(store)) for name, store in selectors.items() if store},
        )


def desired_status(name: str, body: Mapping[str, Any], facts: Facts) -> dict[str, Any]:
    """The status ``name`` should have, given the facts (pure; the daemon's whole logic)."""
    sn = supernode.parse(common.plain(body))
    spec = sn.spec
    selector = inventory.Selector.from_spec(common.to_wire(spec.node_selector))
    members = inventory.members(selector, facts.nodes)
    allocated = {n.name: facts.held.get(n.name, {}).get(spec.card_resource, 0) for n in members}
    summary = inventory.summarize(members, spec.card_resource, allocated, spec.spares.nodes)
    ready, reason, message = _readiness(name, members, summary, facts)
    generation = sn.metadata.generation
    condition = common.Condition(
        type="Ready",
        status=common.ConditionStatus.TRUE if ready else common.ConditionStatus.FALSE,
        reason=reason,
        message=message,
        last_transition_time=clock.SYSTEM.now(),
        observed_generation=generation,
    )
    status = sn.status.model_copy(
        update={
            "observed_generation": generation,
            "nodes": supernode.NodeCounts(total=summary.nodes_total, ready=summary.nodes_ready),
            "cards": supernode.CardCounts(
                total=summary.cards_total,
                allocatable=summary.cards_allocatable,
                allocated=summary.cards_allocated,
                unhealthy=summary.cards_unhealthy,
                spare=summary.cards_spare,
            ),
            "spare_nodes": list(summary.spare_nodes),
            "conditions": common.set_condition(sn.status.conditions, condition),
        }
    )
    return common.to_wire(status)


def _readiness(
    name: str, members: list[inventory.NodeInfo], summary: inventory.PoolSummary, facts: Facts
) -> tuple[bool, str, str]:
    """Ready, with the reason: SelectorOverlap, NoMemberNodes, NoReadyNodes or NodesReady."""
    mine = {n.name for n in members}
    for other, selector in sorted(facts.selectors.items()):
        if other == name:
            continue
        shared = sorted(
            n.name for n in facts.nodes if n.name in mine and selector.matches(n.labels)
        )
        if shared:
            return (
                False,
                "SelectorOverlap",
                f"spec.nodeSelector selects {len(shared)} node(s) that SuperNode {other} "
                f"also selects (first: {shared[0]}); a node belongs to one supernode",
            )
    if not members:
        return False, "NoMemberNodes", "spec.nodeSelector matches no Node"
    if not summary.nodes_ready:
        return False, "NoReadyNodes", f"none of the {summary.nodes_total} member nodes is Ready"
    return (
        True,
        "NodesReady",
        f"{summary.nodes_ready}/{summary.nodes_total} nodes ready, "
        f"{summary.cards_allocatable} cards allocatable, {summary.cards_unhealthy} unhealthy",
    )


def _differs(desired: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    return any(current.get(key) != value for key, value in desired.items())


def _announce(body: kopf.Body, current: Mapping[str, Any], desired: Mapping[str, Any]) -> None:
    """An Event and a log line whenever the Ready condition changes status or reason."""
    old = _ready(current)
    new = _ready(desired)
    if (old.get("status"), old.get("reason")) == (new.get("status"), new.get("reason")):
        return
    kind = "Normal" if new.get("status") == "True" else "Warning"
    kopf.event(body, type=kind, reason=str(new.get("reason")), message=str(new.get("message")))
    log.info(
        "supernode readiness changed",
        supernode=body["metadata"]["name"],
        ready=new.get("status"),
        reason=new.get("reason"),
        message=new.get("message"),
    )


def _ready(status: Mapping[str, Any]) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), {})
