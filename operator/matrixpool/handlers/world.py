"""The read model: one consistent view of the cluster per pass of the main loop, built from the
kopf indexes plus what the operator itself did that the watch does not show yet.

Built by the main loop (:mod:`matrixpool.handlers.loop`); every controller (scheduling,
recovery, time-sharing, SuperNode status) reads the same :class:`World`, and asks it the
questions they share — the topology (:func:`topologies`), the cards held
(:func:`holdings`), how many ranks a job runs now (:func:`replicas_now`), whether it recovers
(:func:`recovery_of`), failed (:func:`failed_reason`) or succeeded (:func:`succeeded`) — so
each has one answer. The pods of a job that succeeded are kept (for their logs) but hold no
card: the World shows them ``released``.

**Decisions** (:class:`Decisions`, by workload UID) are what one controller decided that the
others must see before the API shows it. One writer per field:

==============  ============================  =========================================
field           written by                    read by
==============  ============================  =========================================
``recovering``  recovery (plan, finish)       scheduler (pins new pods), recovery, status
``failed``      recovery (no level left)      scheduler (no pods), recovery, status
``succeeded``   lifecycle (every rank         everyone: the job is finished (pods kept,
                exited 0)                     no cards, no recovery, no time-sharing)
``replicas``    scheduler (shrink, grow)      every ``replicas_now``
``preempting``  scheduler (ask, then evict)   scheduler
==============  ============================  =========================================

An evicted TrainingJob's resume is not a decision here: its open ``status.preemptions``
record (no ``resumedAt``) says it must resume, so an operator restarted in between still
tells the new pods what to restore.

Time-sharing's allowances (:class:`Shares`) are the fourth input: computed by
:mod:`matrixpool.handlers.timeshare` each loop and handed to the others through the World.

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

A pod the operator *created* already reserved (a gang placed before its pods existed) is in
the view from its creation on, as the API server answered it, until the index shows it — or,
if the index never does (created and deleted between two passes), for
:data:`CREATED_SECONDS`; meanwhile its cards are held, never given twice.

Errors: none; building the model reads memory only.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from matrixpool import clock
from matrixpool.api import common, supernode, trainingjob
from matrixpool.handlers.workloads import Workload
from matrixpool.k8s import convert
from matrixpool.placement import inventory, model

log = structlog.get_logger(__name__)
CREATED_SECONDS = 60.0  # a created pod the index never showed leaves the view after this


@dataclass
class Decisions:
    """What controllers decided ahead of the API, by workload UID (table in the module)."""

    # the recovery under way (wire form of status.recovering), None once finished
    recovering: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)  # (reason code, message)
    replicas: dict[str, int] = field(default_factory=dict)  # after a shrink or a grow
    preempting: dict[str, Preempting] = field(default_factory=dict)  # victims asked to save
    # when every rank's pod had Succeeded (status.completionTime until the API shows it)
    succeeded: dict[str, datetime.datetime] = field(default_factory=dict)

    def forget(self, uid: str) -> None:
        for remembered in (
            self.recovering,
            self.failed,
            self.succeeded,
            self.replicas,
            self.preempting,
        ):
            remembered.pop(uid, None)


@dataclass(frozen=True)
class Preempting:
    """A training gang that must give up pods to a higher priority, asked to checkpoint first:
    its pods go when it answers (a step newer than ``baseline`` committed for every rank) or
    when ``grace`` real seconds have passed, whichever comes first."""

    request: str  # the checkpoint request id on its pods
    by: str  # the gang that takes the cards
    priority: int  # that gang's priority
    requested_at: datetime.datetime  # real time of the request
    grace: float  # seconds: the SuperNode's checkpointGraceSeconds, else the default
    baseline: int | None  # newest step committed for every rank when asked
    doomed: tuple[tuple[str, str], ...]  # (namespace, pod) to delete once released
    keep: int | None  # replicas it keeps (a shrink); None: evicted whole


@dataclass
class Shares:
    """Time-sharing's allowances this loop, for the workloads of time-shared SuperNodes only
    (by workload key)."""

    inference: dict[str, dict[str, int]] = field(default_factory=dict)  # key → role → replicas
    training: dict[str, int] = field(default_factory=dict)  # key → replicas; 0 = suspended
    phases: dict[str, trainingjob.Phase] = field(default_factory=dict)  # Checkpointing, Suspended
    # suspended jobs whose pods come back now: time-sharing tells each new pod what to restore
    # before it is bound, so their pods are created first and placed by a later cycle
    resuming: set[str] = field(default_factory=set)

    def governs(self, key: str) -> bool:
        return key in self.inference or key in self.training

    def amend(self, key: str, status: dict[str, Any]) -> dict[str, Any]:
        """A TrainingJob status the scheduler computed, with the time-sharing phase and the
        allowed replicas as ``replicas.desired``."""
        if key not in self.training:
            return status
        replicas = {**status.get("replicas", {}), "desired": self.training[key]}
        amended = {**status, "replicas": replicas}
        if key in self.phases:
            amended["phase"] = self.phases[key].value
        return amended


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
    stale: frozenset[str] = frozenset()  # nodes whose kubelet Lease is overdue
    decisions: Decisions = field(default_factory=Decisions)  # the loop's, shared
    shares: Shares = field(default_factory=Shares)  # time-sharing's latest allowances
    derived: Derived = field(default_factory=Derived, compare=False)  # the loop's cache

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


def recovery_of(world: World, workload: Workload) -> dict[str, Any] | None:
    """The recovery under way for a TrainingJob (wire form), or None."""
    if workload.kind != trainingjob.KIND:
        return None
    if workload.uid in world.decisions.recovering:
        return world.decisions.recovering[workload.uid]
    return cast("dict[str, Any] | None", workload.status.get("recovering"))


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
        for rank, node in (recovery.get("targets") or {}).items():
            cards, _ = inventory.parse_card_list((recovery.get("cards") or {}).get(rank))
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


def holdings(world: World) -> list[model.Holding]:
    """Every card held: by pods (bound, reserved, assumed, terminating) and by recovery pins."""
    priorities = {w.key: w.model.spec.priority if w.model else 0 for w in world.workloads}
    result = pinned(world, priorities)
    for owner, facts in world.pods.items():
        for pod in facts:
            if not pod.holds_cards:
                continue
            training = pod.kind == trainingjob.KIND
            gang = owner if training else f"{owner}/{pod.role}/{pod.replica}"
            result.append(
                model.Holding(
                    pod=model.PodKey(pod.key),
                    gang=model.GangKey(gang),
                    node=inventory.NodeName(pod.node or pod.reserved_node or ""),
                    cards=frozenset(model.CardId(c) for c in pod.cards),
                    priority=priorities.get(owner, 1 << 30),
                    spread_group=None if training else f"{owner}/{pod.role}",
                    requests=pod.requests,
                )
            )
    return result


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
