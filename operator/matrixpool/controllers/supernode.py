"""The SuperNode status: pool the cards of the member Nodes and keep ``status`` current.

kopf indexes hold the facts (Nodes, card-holding Pods, every SuperNode); the operator's main loop
(:mod:`matrixpool.controllers.loop`) calls :func:`report` every cycle, which recomputes each status
and patches only what changed. Because the indexes are rebuilt from the API before the loop
starts, an operator killed at any moment converges to the same status when it comes back.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf
import structlog

from matrixpool import api, clock, metrics
from matrixpool.api import common, inferenceservice, supernode, trainingjob
from matrixpool.k8s import executor
from matrixpool.placement import inventory
from matrixpool.state import world as read_model
from matrixpool.timeshare import windows

GROUP, VERSION, PLURAL = api.GROUP, api.VERSION, supernode.PLURAL

log = structlog.get_logger(__name__)


async def report(
    world: read_model.World,
    last: dict[str, dict[str, Any]],
    act: executor.Executor,
    transitions: Callable[[str], dict[str, Any] | None] = lambda _: None,
) -> None:
    """Patch the status of every SuperNode whose numbers or conditions changed.

    ``last`` remembers what was written, so an unchanged status costs no API call;
    ``transitions(name)`` is the time-sharing transition the loop follows (wire form), if any.
    """
    facts = Facts.collect(world)
    for name, sn in sorted(world.supernodes.items()):
        current = common.to_wire(sn.status)
        desired = desired_status(name, sn, facts, transitions(name))
        metrics.record_supernode(name, desired)
        if desired == last.get(name) or not _differs(desired, current):
            continue
        await act.patch_cluster_status(PLURAL, name, desired)
        _announce(sn, current, desired, act)
        last[name] = desired


@dataclass(frozen=True)
class Facts:
    """What a SuperNode's status is computed from."""

    nodes: list[inventory.NodeInfo]
    held: dict[str, dict[str, int]]  # node name → cards (by resource) held by live pods
    selectors: dict[str, inventory.Selector]  # supernode name → selector
    kinds: dict[str, dict[str, int]] = field(default_factory=dict)  # node → kind → cards held
    members: dict[str, list[inventory.NodeInfo]] = field(default_factory=dict)  # by supernode

    @classmethod
    def collect(cls, world: read_model.World) -> Facts:
        """One pass over the gang pods, one selector per supernode."""
        ours: dict[str, int] = {}  # node → cards held by matrixpool's pods
        kinds: dict[str, dict[str, int]] = {}
        for facts in world.pods.values():
            for pod in facts:
                if pod.holds_cards:
                    node = pod.node or pod.reserved_node or ""
                    ours[node] = ours.get(node, 0) + len(pod.cards)
                    by_kind = kinds.setdefault(node, {})
                    by_kind[pod.kind] = by_kind.get(pod.kind, 0) + len(pod.cards)
        held = {node: dict(resources) for node, resources in world.foreign.items()}
        selectors = {
            name: inventory.Selector.from_spec(common.to_wire(sn.spec.node_selector))
            for name, sn in world.supernodes.items()
        }
        chosen = read_model.members(world)
        for name, sn in world.supernodes.items():
            resource = sn.spec.card_resource
            for member in chosen[name]:
                if member.name in ours:
                    by_resource = held.setdefault(member.name, {})
                    by_resource[resource] = by_resource.get(resource, 0) + ours[member.name]
        return cls(nodes=world.nodes, held=held, selectors=selectors, kinds=kinds, members=chosen)

    def members_of(self, name: str) -> list[inventory.NodeInfo]:
        """The nodes SuperNode ``name`` selects (read_model.members, collected once a pass)."""
        return self.members[name]

    @staticmethod
    def sum_held(pods: kopf.Index[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        held: dict[str, dict[str, int]] = {}
        for node, store in pods.items():
            for resources in store:
                for key, count in resources.items():
                    held.setdefault(node, {})[key] = held.setdefault(node, {}).get(key, 0) + count
        return held


def desired_status(
    name: str, sn: supernode.SuperNode, facts: Facts, followed: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The status ``name`` should have, given the facts (pure)."""
    spec = sn.spec
    members = facts.members_of(name)
    allocated = {n.name: facts.held.get(n.name, {}).get(spec.card_resource, 0) for n in members}
    summary = inventory.summarize(members, spec.card_resource, allocated, spec.spares.nodes)
    ready, reason, message = _readiness(name, members, summary, facts)
    generation = sn.metadata.generation
    window, next_transition = _window(sn, clock.operator())
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
                inference=_by_kind(facts, members, inferenceservice.KIND),
                training=_by_kind(facts, members, trainingjob.KIND),
                free=max(0, summary.cards_allocatable - summary.cards_allocated),
            ),
            "spare_nodes": list(summary.spare_nodes),
            "window": window,
            "next_transition": next_transition,
            "transition": _transition(followed, sn),
            "conditions": common.set_condition(sn.status.conditions, condition),
        }
    )
    wire = common.replacing(status)  # a window or next transition gone is written as gone
    if status.transition is not None:  # nulls clear what the previous transition had set
        wire["transition"] = status.transition.model_dump(mode="json", by_alias=True)
    return wire


def _transition(
    followed: dict[str, Any] | None, sn: supernode.SuperNode
) -> supernode.Transition | None:
    """The transition this process follows, else the one last written."""
    return supernode.Transition.model_validate(followed) if followed else sn.status.transition


def _by_kind(facts: Facts, members: list[inventory.NodeInfo], kind: str) -> int:
    """Cards that pods of ``kind`` (TrainingJob, InferenceService) hold on the members."""
    return sum(facts.kinds.get(n.name, {}).get(kind, 0) for n in members)


def _window(
    sn: supernode.SuperNode, now: clock.Clock
) -> tuple[str | None, datetime.datetime | None]:
    """The time window in force and when the next one starts (None without time-sharing)."""
    sharing = sn.spec.time_sharing
    if sharing is None:
        return None, None
    instant = now.now()
    upcoming = windows.next_boundary(sharing, instant)
    return windows.window_at(sharing, instant).name, upcoming.at if upcoming else None


def _readiness(
    name: str, members: list[inventory.NodeInfo], summary: inventory.PoolSummary, facts: Facts
) -> tuple[bool, str, str]:
    """Ready, with the reason: SelectorOverlap, NoMemberNodes, NoReadyNodes or NodesReady."""
    mine = {n.name for n in members}
    for other in sorted(facts.selectors):
        if other == name:
            continue
        shared = sorted(n.name for n in facts.members_of(other) if n.name in mine)
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


def _announce(
    sn: supernode.SuperNode,
    current: Mapping[str, Any],
    desired: Mapping[str, Any],
    act: executor.Executor,
) -> None:
    """An Event and a log line whenever the Ready condition changes status or reason."""
    old = _ready(current)
    new = _ready(desired)
    if (old.get("status"), old.get("reason")) == (new.get("status"), new.get("reason")):
        return
    kind = "Normal" if new.get("status") == "True" else "Warning"
    ref = {
        "apiVersion": sn.api_version,
        "kind": sn.kind,
        "metadata": {"name": sn.metadata.name, "uid": sn.metadata.uid},
    }
    act.event(ref, kind, str(new.get("reason")), str(new.get("message")))
    log.info(
        "supernode readiness changed",
        supernode=sn.metadata.name,
        ready=new.get("status"),
        reason=new.get("reason"),
        message=new.get("message"),
    )


def _ready(status: Mapping[str, Any]) -> Mapping[str, Any]:
    return next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), {})
