"""What the scheduling cycle keeps: :class:`Memory`, what it remembers between runs (owned by
the main loop), :class:`CycleState`, what the phases of one run share (the world as read and
views of it, the means to act, what earlier phases decided), and the hand-offs between phases
(:class:`Pending`, :class:`Binding`). Every module of :mod:`matrixpool.controllers.scheduling`
reads it; the phases write what they decide into it, and decide nothing here."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from matrixpool.api import trainingjob
from matrixpool.controllers import background
from matrixpool.k8s import convert, executor
from matrixpool.placement import gangs, model
from matrixpool.serving import pool as kv_pool
from matrixpool.state import world as read_model
from matrixpool.state.assumed import Assumed
from matrixpool.state.workloads import Workload
from matrixpool.state.world import World


@dataclass
class Memory:
    """What the cycle remembers between runs, by workload UID (all of it can be lost safely).
    Owned by the main loop."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    reasons: dict[str, model.Reason] = field(default_factory=dict)  # gang → why it waits
    expert_maps: dict[str, str] = field(default_factory=dict)  # workload → content written
    statuses: dict[str, dict[str, Any]] = field(default_factory=dict)  # workload → last patch
    # workload → status.conditions as this cycle last wrote them (their only writer: a stale
    # index never makes it drop one it set)
    conditions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # preempted job → (when asked, newest step committed for every rank)
    answers: dict[str, tuple[float, int | None]] = field(default_factory=dict)
    # evicted job → (preemption request id, the restore value its new pods get; "": none)
    resumes: dict[str, tuple[str, str]] = field(default_factory=dict)
    tasks: background.Tasks = field(default_factory=background.Tasks)  # answer checks by job
    # workload → status.preemptions as this cycle last wrote them (their only writer)
    preemptions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # job → status.resizes as this cycle last wrote them (their only writer; .regroup)
    resizes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # gang → when it preempted (monotonic): until it binds, the cards its victims free are
    # held for it against lower priorities (engine.Snapshot.hold_free)
    nominated: dict[str, float] = field(default_factory=dict)
    # gang → when a cycle could first have placed it, but only across more racks than the
    # fewest that hold it (monotonic): its locality wait runs from then (placement)
    spread_since: dict[model.GangKey, float] = field(default_factory=dict)
    deferred: bool = (
        False  # the last cycle left placeable gangs to the next (placement.PODS_PER_CYCLE)
    )
    kv_reasons: dict[str, str] = field(default_factory=dict)  # service → KV admission told
    kv: dict[str, kv_pool.Decision] = field(default_factory=dict)  # the last cycle's admission
    preempted: bool = False  # the last cycle preempted: the indexes lag its deletions
    # the last cycle's binding cycle (phases 6 and 7), while it writes in the background
    binding: asyncio.Task[None] | None = None
    # pods per second the last binding cycle of at least binding.RATE_SAMPLE_PODS pods wrote
    # (placement.pod_budget); None: none yet
    bind_rate: float | None = None

    def forget(self, uid: str, key: str) -> None:
        """Drop what is remembered of the workload ``uid`` (named ``key``): it went, or its
        name now belongs to another object."""
        self.statuses.pop(uid, None)
        self.expert_maps.pop(uid, None)
        self.answers.pop(uid, None)
        self.resumes.pop(uid, None)
        self.conditions.pop(uid, None)
        self.preemptions.pop(uid, None)
        self.resizes.pop(uid, None)
        self.kv_reasons.pop(uid, None)
        self.tasks.cancel(uid)
        self.tasks.cancel(f"resume/{uid}")
        for gang in [g for g in self.reasons if g == key or g.startswith(key + "/")]:
            del self.reasons[gang]
        for gang in [g for g in self.nominated if g == key or g.startswith(key + "/")]:
            del self.nominated[gang]
        for gang in [g for g in self.spread_since if g == key or g.startswith(key + "/")]:
            del self.spread_since[gang]


@dataclass(frozen=True)
class Pending:
    """A gang with pods still to place (all of them, or the holes of a running gang). A *new*
    gang has no pod yet: ``new`` holds the manifests of its pods, by name; placed, they are
    created with their reservation (no pod is ever created twice: a name taken is an error)."""

    workload: Workload
    gang: gangs.Gang
    pods: list[convert.PodFacts]
    new: Mapping[str, dict[str, Any]] | None = None

    @property
    def request(self) -> model.GangRequest:
        """The whole gang; the engine keeps the cards of pods that already hold some."""
        return self.gang.request


@dataclass(frozen=True)
class Binding:
    pending: Pending
    placement: model.Placement


class CycleState:
    """What the phases of one cycle share; short-lived (one per :class:`.cycle.Cycle`)."""

    def __init__(
        self,
        world: World,
        memory: Memory,
        assumed: Assumed | None = None,
        act: executor.Executor | None = None,
    ) -> None:
        self.world = world
        self.act: executor.Executor = act if act is not None else executor.Live()
        self.memory = memory
        self.assumed = assumed if assumed is not None else Assumed()
        self.preempted = False  # this cycle preempted: the indexes lag (placement, preemption)
        # set by Cycle.schedule
        self.by_gang: dict[model.GangKey, tuple[Workload, gangs.Gang]] = {}
        self.new: list[Pending] = []  # gangs with no pod yet (gangpods.reconcile_pods)
        # not tried: the cycle's pods ran out (placement.place)
        self.deferred: set[model.GangKey] = set()
        self.shares = world.shares  # time-sharing's allowances (controllers.timeshare)
        self.topologies = read_model.topologies(world)
        self.supernode_of: dict[str, str] = {
            str(n.name): t.name for t in self.topologies for n in t.nodes
        }
        self.sizes = {t.name: max((n.cards for n in t.nodes), default=0) for t in self.topologies}
        # service UID → its KV-cache pool decision (set by Cycle: kvadmission.kv_admission)
        self.kv: dict[str, kv_pool.Decision] = {}

    def event(self, workload: Workload, kind: str, reason: str, message: str) -> None:
        self.act.event(workload.ref, kind, reason, message)

    def effective(self, workload: Workload) -> int:
        return read_model.replicas_now(self.world, workload)

    def preemptions(self, workload: Workload) -> list[dict[str, Any]]:
        """status.preemptions as this cycle last wrote them, else as the index shows them."""
        remembered = self.memory.preemptions.get(workload.uid)
        if remembered is not None:
            return [dict(p) for p in remembered]
        return [dict(p) for p in workload.status.get("preemptions") or []]

    def card_resource(self, workload: Workload) -> str:
        assert workload.model is not None
        name = workload.model.spec.super_node
        if name and name in self.world.supernodes:
            return self.world.supernodes[name].spec.card_resource
        first = next(
            iter(sorted(self.world.supernodes.values(), key=lambda s: s.metadata.name)), None
        )
        return first.spec.card_resource if first else "huawei.com/Ascend910"

    async def set_replicas(
        self, workload: Workload, replicas: int, extra: Mapping[str, Any] | None = None
    ) -> None:
        self.world.decisions.resize(workload.uid, replicas)
        await self.act.patch_status(
            trainingjob.PLURAL,
            workload.namespace,
            workload.name,
            {"replicas": {"desired": replicas}, **(extra or {})},
        )
