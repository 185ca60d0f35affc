"""The World: one consistent view of the cluster per pass of the main loop, built from the
kopf indexes (:mod:`matrixpool.state.indexes`) plus what the operator itself did that the
watch does not show yet — the assumed holdings (:mod:`matrixpool.state.assumed`) and the
controllers' decisions (:mod:`matrixpool.state.decisions`).

Built by the main loop (:mod:`matrixpool.controllers.loop`); every controller (scheduling,
recovery, time-sharing, SuperNode status) reads the same :class:`World`, and asks it the
questions they share — the topology (:func:`topologies`), the cards held
(:func:`holdings`), how many ranks a job runs now (:func:`replicas_now`), whether it recovers
(:func:`recovery_of`), failed (:func:`failed_reason`) or succeeded (:func:`succeeded`) — so
each has one answer. The pods of a job that succeeded are kept (for their logs) but hold no
card: the World shows them ``released``.

Nothing here writes: a World is frozen, and what a controller decides for the others goes to
the :class:`~matrixpool.state.decisions.Decisions` it shows (``world.decisions``), whose
module says who writes which field.

Errors: none; building the model reads memory only.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from matrixpool import clock
from matrixpool.api import common, supernode, trainingjob
from matrixpool.k8s import convert
from matrixpool.placement import inventory, model
from matrixpool.state import decisions as decided
from matrixpool.state.workloads import Workload


@dataclass
class Derived:
    """What a pass derives from the Nodes and SuperNodes alone, kept across passes while they
    stay equal: which nodes each SuperNode selects (:func:`members`) and the topologies
    (:func:`topologies`). Rebuilding them three times a pass took most of a 0.2 s cycle at 32
    supernodes of 48 nodes while nothing changed. The loop keeps one; a World built without one
    gets its own, so it only lasts that World."""

    member_key: tuple[Any, ...] | None = None
    members: dict[str, list[inventory.NodeInfo]] = field(default_factory=dict)
    topology_key: tuple[Any, ...] | None = None
    topologies: list[model.SuperNodeTopology] = field(default_factory=list)


@dataclass(frozen=True)
class World:
    """One consistent read of every index, with the assumed holdings applied."""

    supernodes: dict[str, supernode.SuperNode]
    nodes: list[inventory.NodeInfo]
    foreign: dict[str, dict[str, int]]  # node → requests of pods matrixpool did not place
    pods: dict[str, list[convert.PodFacts]]  # "<ns>/<owner>" → its pods
    workloads: list[Workload]
    unreachable: frozenset[str] = frozenset()  # nodes whose checkpoint daemon does not answer
    # nodes whose daemon was stopped on purpose and has not come back yet (a rollout): left
    # out of `unreachable` (matrixpool.k8s.daemonleases.restarting)
    restarting: frozenset[str] = frozenset()
    stale: frozenset[str] = frozenset()  # nodes whose kubelet Lease is overdue
    decisions: decided.Decisions = field(default_factory=decided.Decisions)  # the loop's
    shares: decided.Shares = field(default_factory=decided.Shares)  # time-sharing's latest
    derived: Derived = field(default_factory=Derived, compare=False)  # the loop's cache
    # (node, "down" | "deleted" | "card:<i>") → when the Node watch showed it (monotonic, wall):
    # recovery dates a fault's detection from it (controllers.wake)
    noticed: Mapping[tuple[str, str], tuple[float, datetime.datetime]] = field(
        default_factory=dict, compare=False
    )

    def __post_init__(self) -> None:
        """The pods of jobs that succeeded hold no card (they are kept for their logs)."""
        done = {w.key for w in self.workloads if completed(self, w) is not None}
        if done:
            pods = {
                owner: [dataclasses.replace(p, released=True) for p in facts]
                if owner in done
                else facts
                for owner, facts in self.pods.items()
            }
            object.__setattr__(self, "pods", pods)


# ---- the shared answers --------------------------------------------------------------------


def replicas_now(world: World, workload: Workload) -> int:
    """The replicas a TrainingJob runs now — the one answer: time-sharing's allowance when a
    time-shared SuperNode governs it, else :func:`effective_replicas`."""
    if workload.key in world.shares.training:
        return world.shares.training[workload.key]
    return effective_replicas(workload, world.decisions.replicas.get(workload.uid))


def effective_replicas(workload: Workload, decided: int | None = None) -> int:
    """spec.replicas, unless preemption shrank the job (``decided`` this process's latest
    decision, else status.replicas.desired)."""
    assert isinstance(workload.model, trainingjob.TrainingJob)
    spec = workload.model.spec
    shrunk = (
        decided if decided is not None else (workload.status.get("replicas") or {}).get("desired")
    )
    if isinstance(shrunk, int) and spec.min_replicas <= shrunk < spec.replicas:
        return shrunk
    return spec.replicas


def recovery_of(world: World, workload: Workload) -> decided.RecoveryPlan | None:
    """The recovery under way for a TrainingJob, or None."""
    if workload.kind != trainingjob.KIND:
        return None
    if workload.uid in world.decisions.recovering:
        return world.decisions.recovering[workload.uid]
    return decided.RecoveryPlan.read(workload.status.get("recovering"))


def pods_held(world: World, workload: Workload) -> int:
    """The pods a TrainingJob holds: its live ones, and while a recovery replaces them the
    ranks it brings back (replaced, not released: time-sharing keeps the job's size)."""
    live = sum(1 for p in world.pods.get(workload.key, []) if not p.deleting)
    recovery = recovery_of(world, workload)
    return live if recovery is None else max(live, recovery.world_size)


def failed_reason(world: World, workload: Workload) -> str | None:
    """Why a TrainingJob failed for good (maxRecoveries, no recovery possible), or None."""
    if workload.uid in world.decisions.failed:
        return world.decisions.failed[workload.uid][1]
    if workload.status.get("phase") == trainingjob.Phase.FAILED.value:
        return "failed"
    return None


def completed(world: World, workload: Workload) -> datetime.datetime | None:
    """When a TrainingJob succeeded (every rank's pod exited 0), or None: it never goes back."""
    if workload.kind != trainingjob.KIND:
        return None
    if workload.uid in world.decisions.succeeded:
        return world.decisions.succeeded[workload.uid]
    if workload.status.get("phase") != trainingjob.Phase.SUCCEEDED.value:
        return None
    when = workload.status.get("completionTime")
    if isinstance(when, datetime.datetime):
        return when
    try:
        return datetime.datetime.fromisoformat(str(when).replace("Z", "+00:00"))
    except ValueError:  # written without one (by hand): finished, since the epoch
        return datetime.datetime.fromtimestamp(0, datetime.UTC)


def succeeded(world: World, workload: Workload) -> bool:
    return completed(world, workload) is not None


def members(world: World) -> dict[str, list[inventory.NodeInfo]]:
    """Every SuperNode's member nodes, in name order (one walk over the nodes per SuperNode,
    kept while the selectors and the nodes stay equal)."""
    derived = world.derived
    key = (
        tuple((name, sn.spec.node_selector) for name, sn in sorted(world.supernodes.items())),
        world.nodes,
    )
    if derived.member_key != key:
        derived.members = {
            name: inventory.members(
                inventory.Selector.from_spec(common.to_wire(sn.spec.node_selector)), world.nodes
            )
            for name, sn in world.supernodes.items()
        }
        derived.member_key = key
    return derived.members


def topologies(world: World) -> list[model.SuperNodeTopology]:
    """Every SuperNode's nodes and usable cards: ready, healthy, uncordoned, with a daemon and
    a kubelet heartbeat, less what pods matrixpool did not place hold; and what placement checks
    besides cards: labels, taints, cordon and the room left by those pods. Kept while its inputs
    stay equal (:class:`Derived`); callers must not change it."""
    silent = world.unreachable | world.stale  # no daemon or no kubelet heartbeat: nothing new
    key = (
        tuple((name, sn.spec) for name, sn in sorted(world.supernodes.items())),
        world.nodes,
        world.foreign,
        silent,
    )
    derived = world.derived
    if derived.topology_key != key:
        derived.topologies = _topologies(world, silent)
        derived.topology_key = key
    return list(derived.topologies)


def _topologies(world: World, silent: frozenset[str]) -> list[model.SuperNodeTopology]:
    result = []
    chosen = members(world)
    for name, sn in sorted(world.supernodes.items()):
        spec = sn.spec
        groups = (
            tuple(
                tuple(model.CardId(c) for c in g if c < spec.cards_per_node)
                for g in spec.card_groups
            )
            if spec.card_groups
            else ()
        )
        slots = []
        for node in chosen[name]:
            cards = node.cards.get(spec.card_resource, 0)
            foreign = world.foreign.get(node.name, {}).get(spec.card_resource, 0)
            usable = (
                frozenset(
                    model.CardId(c) for c in range(cards - foreign) if c not in node.unhealthy
                )
                if node.ready and node.name not in silent
                else frozenset()
            )
            domains = tuple(node.labels.get(k, "") for k in spec.topology_keys)
            slots.append(
                model.NodeSlot(
                    node.name,
                    name,
                    domains,
                    cards,
                    groups,
                    usable,
                    labels=tuple(sorted(node.labels.items())),
                    taints=node.taints,
                    room=_room(node, world.foreign.get(node.name, {}), spec.card_resource),
                    cordoned=node.cordoned,
                )
            )
        slots.sort(key=lambda s: (s.domains, s.name))
        result.append(
            model.SuperNodeTopology(name, spec.card_resource, tuple(slots), spec.spares.nodes)
        )
    return result


def _room(
    node: inventory.NodeInfo, foreign: Mapping[str, int], card_resource: str
) -> tuple[tuple[str, int], ...]:
    """What the node's allocatable leaves to matrixpool's pods besides cards, once the pods it
    did not place have their requests (the pod count is not checked)."""
    return tuple(
        sorted(
            (r, amount - foreign.get(r, 0))
            for r, amount in node.allocatable.items()
            if r not in (card_resource, "pods")
        )
    )


def pinned(world: World, priorities: Mapping[str, int]) -> list[model.Holding]:
    """Cards a recovery has promised to ranks whose new pod does not exist yet: no other gang
    may take them in between (the old pod is gone, the new one not yet created)."""
    result = []
    for workload in world.workloads:
        recovery = recovery_of(world, workload)
        if not recovery:
            continue
        present = {p.rank for p in world.pods.get(workload.key, []) if p.holds_cards}
        for rank, node in recovery.targets.items():
            target = recovery.target(int(rank))
            cards, _ = inventory.parse_card_list(target[1] if target else None)
            if int(rank) in present or not cards:
                continue
            result.append(
                model.Holding(
                    pod=model.PodKey(f"{workload.key}#pin-{rank}"),
                    gang=model.GangKey(workload.key),
                    node=inventory.NodeName(node),
                    cards=frozenset(model.CardId(c) for c in cards),
                    priority=priorities.get(workload.key, 1 << 30),
                    spread_group=None,
                )
            )
    return result


# A pod going away counts as leaving (a gang may wait for its cards: placement.engine) only
# while its grace ends within this long, and until it is this long overdue: a pod stuck in
# Terminating (a finalizer, a kubelet that cannot kill it) must not hold a gang back for good.
LEAVING_AHEAD_SECONDS = 30.0  # the default terminationGracePeriodSeconds
LEAVING_OVERDUE_SECONDS = 5.0


def leaving(pod: convert.PodFacts, owned: bool, now: float) -> bool:
    """Whether ``pod``'s cards are about to be free: it is being deleted (and its grace ends
    within :data:`LEAVING_AHEAD_SECONDS`, not more than :data:`LEAVING_OVERDUE_SECONDS` ago),
    or its workload is gone (``owned`` False: deleted next)."""
    if not pod.deleting:
        return not owned
    if not pod.gone_by:
        return True
    return now - LEAVING_OVERDUE_SECONDS <= pod.gone_by <= now + LEAVING_AHEAD_SECONDS


def holdings(world: World) -> list[model.Holding]:
    """Every card held: by pods (bound, reserved, assumed, terminating) and by recovery pins.
    A pod deleting, or whose workload is gone, is ``leaving`` unless its node is down or its
    kubelet silent (its cards may then never come back)."""
    priorities = {w.key: w.model.spec.priority if w.model else 0 for w in world.workloads}
    result = pinned(world, priorities)
    dead = {n.name for n in world.nodes if n.down} | world.stale
    now = clock.SYSTEM.now().timestamp()
    for owner, facts in world.pods.items():
        for pod in facts:
            if not pod.holds_cards:
                continue
            training = pod.kind == trainingjob.KIND
            gang = owner if training else f"{owner}/{pod.role}/{pod.replica}"
            node = pod.node or pod.reserved_node or ""
            result.append(
                model.Holding(
                    pod=model.PodKey(pod.key),
                    gang=model.GangKey(gang),
                    node=inventory.NodeName(node),
                    cards=frozenset(model.CardId(c) for c in pod.cards),
                    priority=priorities.get(owner, 1 << 30),
                    spread_group=None if training else f"{owner}/{pod.role}",
                    requests=pod.requests,
                    leaving=node not in dead and leaving(pod, owner in priorities, now),
                )
            )
    return result


def disagreeing(live: Sequence[convert.PodFacts], size: int) -> int | None:
    """The world of the gang's live ranks when any of them was made for another size than
    ``size`` (the smallest such world: the one whose steps are complete for every rank), else
    None (pure; the scheduler regroups such a gang, the recovery sees no fault in it). Pods
    that do not say their world (made by an older operator) do not count."""
    worlds = {p.world for p in live if p.world}
    if not worlds or worlds == {size}:
        return None
    return min(worlds)
