"""The scheduling cycle: keeps the pods of every gang in existence, places whole gangs onto
cards with the pure engine, binds them, preempts lower priorities, and reports status.

One cycle runs at a time for the whole operator: the main loop (:mod:`matrixpool.controllers.loop`)
calls :func:`run_cycle` on one read model (:mod:`matrixpool.state.world`), whose assumed
holdings count what earlier cycles reserved and bound until the watch shows it, so no card can
be given twice. Binding is two-phase (reserve every pod of the gang, then bind each; see
:mod:`matrixpool.k8s.pods`), so an operator killed at any moment comes back, rebuilds the
holdings from the pods' annotations, and finishes or undoes a half-bound gang.

The main loop runs phases 6 and 7 as a binding cycle apart from the scheduling cycle (as
kube-scheduler does): the scheduling cycle decides, its binding cycle writes in the background
while the loop's recovery goes on, and the next scheduling cycle (and the controllers that read
what bindings write: time-sharing, the SuperNode status) starts only once that binding cycle is
through, so a decision never rests on a world that lacks the last cycle's writes. A cycle
with nothing to bind reports at once. ``matrixpool_cycle_seconds`` times the scheduling cycle,
``matrixpool_gang_bind_seconds`` the bindings.

Cycle phases: 1 read the world, 2 the gangs each workload wants, 3 create missing pods and
delete surplus ones (a finished job's pods are kept until its ttl:
:mod:`matrixpool.controllers.lifecycle`), 4 finish or undo half-done bindings, 4b victims of a
preemption that checkpointed (or ran out of grace) give up their pods, 5 place pending gangs
highest priority first (preempting if needed: training that checkpoints is asked first),
6 reserve and bind, 7 write each workload's status, composed once. Every action goes through
the executor the cycle is given (:mod:`matrixpool.k8s.executor`), so the cycle's plans are
unit-tested with a recording one.

One writer per status field of a TrainingJob or InferenceService (merge patches of disjoint
fields cannot undo each other; each writer remembers what it wrote, so a lagging index never
makes it drop a condition):

=======================================================  ==================================
field                                                    writer
=======================================================  ==================================
``phase``, ``replicas``, ``placement``, ``conditions``,  this cycle (phase 7; ``replicas``,
``observedGeneration``, ``roles``, ``roleSummary``,      ``conditions`` and ``preemptions``
``expertMap``, ``preemptions``, ``completionTime``       also at a preemption)
``recovering``, ``recoveries``, ``recoveryCount``,       :mod:`matrixpool.controllers.recovery`
``checkpoints``
``timeSharing``                                          :mod:`matrixpool.controllers.timeshare`
=======================================================  ==================================
"""

from __future__ import annotations

import asyncio
import copy
import json
import posixpath
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from matrixpool import clock, metrics
from matrixpool.api import common, inferenceservice, labels, trainingjob
from matrixpool.controllers import background, lifecycle
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import convert, daemons, executor, pods
from matrixpool.placement import engine, gangs, model, servable
from matrixpool.serving import pool as kv_pool
from matrixpool.state import decisions
from matrixpool.state import world as read_model
from matrixpool.state.assumed import Assumed
from matrixpool.state.workloads import Workload
from matrixpool.state.world import World
from matrixpool.timeshare import transition
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)

DEFAULT_GRACE_SECONDS = 60.0  # a preempted job's checkpoint grace without a SuperNode's own
CHECK_SECONDS = 0.5  # a preempted job's daemons are asked at most this often
NOMINATION_SECONDS = 300.0  # a preemptor's hold on the cards its victims free lasts this long
# Pods one cycle binds at most (a larger gang still goes whole, alone): a cycle that binds
# hundreds of pods keeps recovery, time-sharing and the status report waiting for seconds
# (32 supernodes, 512 jobs submitted at once: one cycle bound 690 pods in 8.9 s). The gangs
# left over wait for the next cycle, which the loop starts at once (Memory.deferred).
PODS_PER_CYCLE = 96


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
    # gang → when it preempted (monotonic): until it binds, the cards its victims free are
    # held for it against lower priorities (engine.Snapshot.hold_free)
    nominated: dict[str, float] = field(default_factory=dict)
    deferred: bool = False  # the last cycle left placeable gangs to the next (PODS_PER_CYCLE)
    kv_reasons: dict[str, str] = field(default_factory=dict)  # service → KV admission told
    kv: dict[str, kv_pool.Decision] = field(default_factory=dict)  # the last cycle's admission
    preempted: bool = False  # the last cycle preempted: the indexes lag its deletions
    # the last cycle's binding cycle (phases 6 and 7), while it writes in the background
    binding: asyncio.Task[None] | None = None

    def forget(self, uid: str, key: str) -> None:
        """Drop what is remembered of the workload ``uid`` (named ``key``): it went, or its
        name now belongs to another object."""
        self.statuses.pop(uid, None)
        self.expert_maps.pop(uid, None)
        self.answers.pop(uid, None)
        self.resumes.pop(uid, None)
        self.conditions.pop(uid, None)
        self.preemptions.pop(uid, None)
        self.kv_reasons.pop(uid, None)
        self.tasks.cancel(uid)
        for gang in [g for g in self.reasons if g == key or g.startswith(key + "/")]:
            del self.reasons[gang]
        for gang in [g for g in self.nominated if g == key or g.startswith(key + "/")]:
            del self.nominated[gang]


async def run_cycle(
    world_reader: Any,
    memory: Memory,
    assumed: Assumed,
    act: executor.Executor,
    *,
    background: bool = False,
) -> bool:
    """Run one cycle; ``world_reader()`` → World. Serialized by a lock, as a safety net.
    What the cycle reserves, binds and deletes goes into ``assumed``; ``act`` carries it out.

    ``background``: return once the scheduling cycle has decided, its binding cycle left to
    run as a task (``memory.binding``) when it has gangs to bind. False when no cycle ran
    because the last one's binding cycle is still writing."""
    async with memory.lock:
        if memory.binding is not None:
            if not memory.binding.done():
                return False
            memory.binding = None
        cycle = Cycle(world_reader(), memory, assumed, act)
        with metrics.CYCLE_SECONDS.time():
            decided = await cycle.schedule()
        if not background or not decided[1]:  # nothing to bind: report at once
            await cycle.finish(*decided)
            return True
        memory.binding = asyncio.create_task(_binding_cycle(cycle, decided))
        return True


async def _binding_cycle(
    cycle: Cycle,
    decided: tuple[Mapping[str, list[gangs.Gang]], list[Binding], set[model.GangKey]],
) -> None:
    try:
        await cycle.finish(*decided)
    except Exception:  # the next cycle finishes or undoes what this one left half done
        log.exception("binding cycle failed; the next cycle retries")


async def settle(memory: Memory) -> None:
    """Wait for the last cycle's binding cycle, if one is still writing (the loop stops)."""
    if memory.binding is not None:
        await asyncio.gather(memory.binding, return_exceptions=True)


class Cycle:
    """One pass over the world; short-lived."""

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
        self.preempted = False
        self.by_gang: dict[model.GangKey, tuple[Workload, gangs.Gang]] = {}  # set by run()
        self.new: list[Pending] = []  # gangs with no pod yet (reconcile_pods)
        self.deferred: set[model.GangKey] = set()  # not tried: the cycle's pods ran out (place)
        self.shares = world.shares  # time-sharing's allowances (handlers.timeshare)
        self.topologies = read_model.topologies(world)
        self.supernode_of: dict[str, str] = {
            str(n.name): t.name for t in self.topologies for n in t.nodes
        }
        self.sizes = {t.name: max((n.cards for n in t.nodes), default=0) for t in self.topologies}
        self.kv = kv_admission(world, memory)  # service UID → its KV-cache pool decision

    async def run(self) -> None:
        """The whole cycle: the scheduling cycle, then its binding cycle."""
        await self.finish(*await self.schedule())

    async def schedule(
        self,
    ) -> tuple[Mapping[str, list[gangs.Gang]], list[Binding], set[model.GangKey]]:
        """Phases 2-5: what to bind (and what each workload wants, and the new gangs tried)."""
        self.memory.kv = self.kv  # for the KV quota controller (handlers.kvquotas)
        wanted = {w.key: self.gangs_of(w) for w in self.world.workloads if w.model}  # phase 2
        by_key = {w.key: w for w in self.world.workloads}
        self.by_gang = {g.request.gang: (by_key[key], g) for key, gs in wanted.items() for g in gs}
        await self.reconcile_pods(wanted)  # phase 3
        pending = await self.finish_half_bound(wanted) + self.new  # phase 4
        await self.finish_preemptions()  # phase 4b: victims that answered or ran out of grace
        bindings = await self.place(pending)  # phase 5
        metrics.PENDING_GANGS.set(len(pending) - len(bindings))
        tried = {b.placement.gang for b in bindings} | self.deferred
        self.memory.preempted = self.preempted
        return wanted, bindings, tried

    async def finish(
        self,
        wanted: Mapping[str, list[gangs.Gang]],
        bindings: list[Binding],
        tried: set[model.GangKey],
    ) -> None:
        """Phases 6-7, the binding cycle: reserve and bind, then report."""
        done = await self.bind(bindings)  # phase 6
        await self.create_unplaced(tried)  # phase 6b: new gangs that wait get pods to show it
        if not self.preempted:  # after a preemption the indexes lag: report next cycle
            await self.report(wanted, done)  # phase 7

    # ---- phase 2: what each workload wants ---------------------------------------------------

    def gangs_of(self, workload: Workload) -> list[gangs.Gang]:
        if isinstance(workload.model, trainingjob.TrainingJob):
            if read_model.failed_reason(self.world, workload) is not None:
                return []  # a failed job keeps no pods
            if read_model.succeeded(self.world, workload):
                return []  # finished: nothing to place (its pods stay: reconcile_pods)
            spec = workload.model.spec
            size = self.sizes.get(spec.super_node or "") or max(self.sizes.values(), default=0)
            replicas = self.effective(workload)
            if replicas == 0:
                return []  # suspended by a time-sharing window
            return [
                gangs.training_gang(
                    workload.namespace,
                    workload.name,
                    spec,
                    size,
                    replicas,
                    card_resource=self.card_resource(workload),
                )
            ]
        assert isinstance(workload.model, inferenceservice.InferenceService)
        if isinstance(self.kv.get(workload.uid), kv_pool.Waiting):
            return []  # its KV cache does not fit the pool: no pods until it does
        return gangs.inference_gangs(
            workload.namespace,
            workload.name,
            workload.served_spec(),
            replicas=self.shares.inference.get(workload.key),  # None: not time-shared
            card_resource=self.card_resource(workload),
        )

    # ---- phase 3: pods exist exactly for the wanted gangs ----------------------------------

    async def reconcile_pods(self, wanted: Mapping[str, list[gangs.Gang]]) -> None:
        for workload in self.world.workloads:
            if read_model.succeeded(self.world, workload):
                await self.expire(workload)  # kept for their logs until the ttl
                continue
            existing = {p.name: p for p in self.world.pods.get(workload.key, [])}
            plans = [p for g in wanted.get(workload.key, []) for p in g.pods]
            names = {p.name for p in plans}
            template = self.template(workload)
            resource = self.card_resource(workload)
            recovery = read_model.recovery_of(self.world, workload)
            missing = [plan for plan in plans if plan.name not in existing]
            resume = self.resume_value(workload, existing) if missing and not recovery else ""
            wanted_gangs = wanted.get(workload.key, [])
            contracts = training_contracts(workload, wanted_gangs, existing) if missing else {}
            serving = self.serving_contract(workload) if missing else None
            manifests = {
                plan.name: pin(
                    pods.manifest(
                        plan,
                        template(plan.role),
                        workload.ref,
                        resource,
                        contracts.get(plan.name),
                        serving,
                    ),
                    recovery,
                    resume,
                )
                for plan in missing
                if resume is not None  # None: an evicted job's restore is not known yet
            }
            # A recovery's new pods come reserved on their targets; a resuming job's are told
            # what to restore by time-sharing before they are bound.
            if not recovery and workload.key not in self.shares.resuming:
                for gang in wanted_gangs:
                    members = [p.name for p in gang.pods]
                    if members and all(n in manifests for n in members):  # none exists: new
                        new = {n: manifests.pop(n) for n in members}
                        self.new.append(Pending(workload, gang, [], new))
            create = list(manifests.values())
            surplus = [p for p in existing.values() if p.name not in names and not p.deleting]
            try:
                if create:
                    await self.act.create_pods(create)
                if surplus:
                    await self.act.delete_pods([(p.namespace, p.name) for p in surplus])
                    for p in surplus:
                        self.assumed.deleting(p)
            except Exception as error:  # e.g. a namespace being deleted: the others go on
                log.warning("could not reconcile pods", workload=workload.key, error=str(error))

    async def expire(self, workload: Workload) -> None:
        """The pods of a finished job go once spec.ttlSecondsAfterFinished has passed."""
        going = lifecycle.expired(self.world, workload, clock.SYSTEM.now())
        if not going:
            return
        await self.act.delete_pods([(p.namespace, p.name) for p in going])
        for p in going:
            self.assumed.deleting(p)
        self.event(workload, "Normal", "PodsDeleted", f"ttl passed: {len(going)} pods deleted")

    def resume_value(
        self, workload: Workload, existing: Mapping[str, convert.PodFacts]
    ) -> str | None:
        """What the new pods of a TrainingJob evicted by a preemption restore ("" when it was
        not evicted, or nothing was committed), or None while that is not known yet.

        Known once every old pod is gone (the trainers save until they stop) and the daemons
        of its SuperNode and its tier 3 have told the newest step committed for every rank
        then — asked in the background (:meth:`find_resume`), the answer read by a later
        cycle. The open ``status.preemptions`` record says the job must resume, so a restarted
        operator does the same; pods already told keep what they were told."""
        opened = self.open_eviction(workload)
        if opened is None:
            return ""
        request = str(opened.get("requestId") or "")
        tag = f"preempt-{request}"
        told = [p for p in existing.values() if restore_codec.restore_id(p.restore) == tag]
        if told:
            return told[0].restore
        cached = self.memory.resumes.get(workload.uid)
        if cached is not None and cached[0] == request:
            return cached[1]
        if existing:
            return None  # the evicted pods are still going
        self.memory.tasks.start(f"resume/{workload.uid}", self.find_resume(workload, request))
        return None

    def open_eviction(self, workload: Workload) -> Mapping[str, Any] | None:
        """The newest preemption of a TrainingJob that evicted it whole and has not resumed."""
        if not isinstance(workload.model, trainingjob.TrainingJob):
            return None
        history = self.preemptions_of(workload)
        last = history[-1] if history else None
        if last is None or last.get("resumedAt") or last.get("replicasKept") is not None:
            return None
        return last

    async def find_resume(self, workload: Workload, request: str) -> None:
        """The restore value of an evicted job's new pods: the newest step every rank
        committed (one incarnation) on its SuperNode's daemons or its tier 3."""
        assert isinstance(workload.model, trainingjob.TrainingJob)
        spec = workload.model.spec
        tiers = spec.checkpoint
        value = ""
        if tiers.memory or tiers.local or tiers.persistent:
            home = spec.super_node
            endpoints = {
                str(n.name): n.endpoint
                for n in self.world.nodes
                if n.endpoint and (not home or self.supernode_of.get(str(n.name)) == home)
            }
            persistent = tiers.persistent.uri if tiers.persistent else None
            found = await self.act.inventory(workload.uid, endpoints, persistent)
            step = found.newest_complete(read_model.replicas_now(self.world, workload))
            if step is not None:
                value = restore_codec.restore_value(
                    step,
                    found.holders(step),
                    f"preempt-{request}",
                    incarnation=found.new_incarnation(clock.SYSTEM.now()),
                    of=found.incarnation_of(step),
                )
        self.memory.resumes[workload.uid] = (request, value)
        log.info("evicted job resumes", job=workload.key, request=request, restore=value or None)

    def serving_contract(self, workload: Workload) -> pods.ServingContract | None:
        """The KV-cache pool's part of the pods of a service whose KV cache is admitted: the
        daemons of its SuperNode's member nodes (those announced now) and its token."""
        kv = self.kv.get(workload.uid)
        if not isinstance(kv, kv_pool.Admitted):
            return None
        members = read_model.members(self.world).get(kv.super_node, ())
        port, _, _ = pods.daemon_settings()
        return pods.ServingContract(
            service_uid=workload.uid,
            daemons=tuple(sorted({n.endpoint for n in members if n.endpoint})),
            daemon_port=port,
            credential=daemons.secret() is not None,  # then handlers.credentials writes it
        )

    def template(self, workload: Workload) -> Any:
        if isinstance(workload.model, trainingjob.TrainingJob):
            template = workload.model.spec.template
            return lambda role: template
        assert isinstance(workload.model, inferenceservice.InferenceService)
        roles = {r.name: r.template for r in workload.model.spec.roles}
        return lambda role: roles.get(role, {})

    def card_resource(self, workload: Workload) -> str:
        assert workload.model is not None
        name = workload.model.spec.super_node
        if name and name in self.world.supernodes:
            return self.world.supernodes[name].spec.card_resource
        first = next(
            iter(sorted(self.world.supernodes.values(), key=lambda s: s.metadata.name)), None
        )
        return first.spec.card_resource if first else "huawei.com/Ascend910"

    # ---- phase 4: finish or undo half-done bindings ----------------------------------------

    async def finish_half_bound(self, wanted: Mapping[str, list[gangs.Gang]]) -> list[Pending]:
        """Gangs still to place; binds fully reserved gangs, clears partial reservations."""
        pending: list[Pending] = []
        finish: list[convert.PodFacts] = []
        owners: dict[str, tuple[Workload, model.GangKey]] = {}  # pod key -> its gang
        undo: list[convert.PodFacts] = []
        for workload in self.world.workloads:
            facts = {p.name: p for p in self.world.pods.get(workload.key, [])}
            for gang in wanted.get(workload.key, []):
                pods_now = [facts.get(p.name) for p in gang.pods]
                if any(p is None or p.deleting for p in pods_now):
                    continue  # wait until every pod exists (and old ones are gone)
                present = [p for p in pods_now if p is not None]
                state = gang_state(present)
                if state == "reserved":
                    finish += [p for p in present if not p.node]
                    owners.update({p.key: (workload, gang.request.gang) for p in present})
                elif state == "partial":
                    undo += [p for p in present if p.reserved_node]
                elif state in ("unplaced", "holed"):
                    pending.append(Pending(workload, gang, present))
        if undo:
            log.info("clearing partial reservations", pods=len(undo))
            await self.act.unreserve([(p.namespace, p.name) for p in undo])
            for p in undo:
                self.assumed.released(p)
        if finish:
            log.info("finishing reserved gangs", pods=len(finish))
            outcomes = await self.act.bind(
                [(p.namespace, p.name, p.reserved_node or "") for p in finish]
            )
            refused: set[model.GangKey] = set()
            for p, outcome in zip(finish, outcomes, strict=True):
                workload, key = owners[p.key]
                if not self.bound(p, p.reserved_node or "", p.cards, outcome):
                    refused.add(key)
                    self.refused(workload, key, "bind", outcome)
            for _, key in owners.values():
                reason = self.memory.reasons.get(key)
                if key not in refused and reason is not None and reason.code == FORBIDDEN:
                    self.memory.reasons.pop(key, None)
        return pending

    # ---- phase 5: place, highest priority first ---------------------------------------------

    async def place(self, pending: list[Pending]) -> list[Binding]:
        growable = self.growable()
        if not pending and not growable:  # a steady cycle: no snapshot to build
            self.memory.deferred = False
            self.deferred = set()
            return []
        snapshot = engine.Snapshot.build(self.topologies, read_model.holdings(self.world))
        victims = {key: gang.request for key, (_, gang) in self.by_gang.items()}
        bindings: list[Binding] = []
        never: set[model.GangKey] = set()  # gangs that can never be served: they block nobody
        pending.sort(
            key=lambda p: (-p.gang.request.priority, p.workload.created, p.gang.request.gang)
        )
        self.memory.deferred = False
        summaries = servable.summaries(self.topologies)
        budget = PODS_PER_CYCLE
        deferred: list[Pending] = []
        for item in pending:
            request = item.request
            if budget <= 0:  # the rest, in the same order, next cycle
                deferred.append(item)
                continue
            verdict: model.Placement | model.Unplaceable | None
            verdict = engine.check_servable(self.topologies, request, summaries)
            if verdict is None:
                verdict = engine.place(snapshot, request)
            key = item.gang.request.gang
            if isinstance(verdict, model.Placement):
                snapshot.commit(verdict)
                bindings.append(Binding(item, verdict))
                budget -= len(verdict.assignments)
                self.memory.reasons.pop(key, None)
                self.memory.nominated.pop(key, None)
                continue
            if not verdict.permanent and (self.world.decisions.preempting or self.preempted):
                if self.nominated(key):  # it waits for its victims' checkpoint
                    planned = engine.preempt(snapshot, request, victims)
                    if isinstance(planned, model.Preemption):
                        snapshot.hold_free(planned.placement)
                self.note_reason(item, WAITING_FOR_CHECKPOINT)  # the cards are about to move
                continue
            if not verdict.permanent:
                preemption = engine.preempt(snapshot, request, victims)
                if isinstance(preemption, model.Preemption):
                    if await self.preempt(item, preemption):
                        self.memory.nominated[key] = clock.SYSTEM.monotonic()
                        self.preempted = True
                        return bindings  # the world changes; place again next cycle
                    snapshot.hold_free(preemption.placement)  # its victims' pods are going
                    self.note_reason(item, CARDS_BEING_FREED)
                    continue
            self.note_reason(item, verdict.reasons[0])
            if verdict.permanent:
                never.add(item.gang.request.gang)
        self.memory.deferred = bool(deferred)
        self.deferred = {p.gang.request.gang for p in deferred}
        placed = {b.placement.gang for b in bindings} | never
        waiting = [p.gang.request.priority for p in pending if p.gang.request.gang not in placed]
        await self.grow(snapshot, max(waiting, default=None), growable)
        return bindings

    def growable(self) -> list[Workload]:
        """Shrunk training jobs that may grow back here (time-sharing grows its own; a
        finished job never does)."""
        found = []
        for workload in self.world.workloads:
            if not isinstance(workload.model, trainingjob.TrainingJob):
                continue
            if self.effective(workload) >= workload.model.spec.replicas:
                continue
            if self.shares.governs(workload.key) or read_model.succeeded(self.world, workload):
                continue
            found.append(workload)
        return found

    async def grow(
        self, snapshot: engine.Snapshot, waiting: int | None, growable: Sequence[Workload]
    ) -> None:
        """Rule: a shrunk elastic job (of ``growable``) grows back to spec.replicas once the
        whole gang fits again on free cards, and no gang of its priority or higher still waits
        for cards."""
        for workload in growable:
            assert isinstance(workload.model, trainingjob.TrainingJob)
            spec = workload.model.spec
            if waiting is not None and waiting >= spec.priority:
                continue
            size = self.sizes.get(spec.super_node or "") or max(self.sizes.values(), default=0)
            full = gangs.training_gang(
                workload.namespace,
                workload.name,
                spec,
                size,
                card_resource=self.card_resource(workload),
            )
            verdict = engine.place(snapshot, full.request)
            if isinstance(verdict, model.Placement):
                snapshot.commit(verdict)
                await self.set_replicas(workload, spec.replicas)
                self.event(workload, "Normal", "Grown", f"grown back to {spec.replicas} replicas")

    def nominated(self, gang: str) -> bool:
        """Whether ``gang`` preempted within :data:`NOMINATION_SECONDS` and has not bound."""
        at = self.memory.nominated.get(gang)
        if at is not None and clock.SYSTEM.monotonic() - at > NOMINATION_SECONDS:
            del self.memory.nominated[gang]
            return False
        return at is not None

    def note_reason(self, item: Pending, reason: model.Reason) -> None:
        """Remember why a gang waits; a Warning Event when the reason is new."""
        key = item.gang.request.gang
        if self.memory.reasons.get(key) != reason:
            self.event(item.workload, "Warning", reason.code, f"gang {key}: {reason.message}")
            log.info("gang waits", gang=key, reason=reason.code, message=reason.message)
        self.memory.reasons[key] = reason

    async def preempt(self, item: Pending, plan: model.Preemption) -> bool:
        """Ask every victim to checkpoint; training that saves checkpoints gives up its pods
        when it answers or its grace is over (phase 4b), the rest at once. False when every
        victim's pods already go (nothing to do but wait for their cards)."""
        by, priority = item.gang.request.gang, item.gang.request.priority
        request_id = uuid.uuid4().hex[:12]
        victims: list[tuple[Workload, list[tuple[str, str]], int | None]] = []
        for key, keep in plan.shrink.items():
            workload, gang = self.by_gang[key]
            per = max(1, len(gang.pods) // max(1, self.effective(workload)))
            victims.append(
                (workload, [(p.namespace, p.name) for p in gang.pods[keep:]], keep // per)
            )
        for key in plan.evict:
            workload, gang = self.by_gang[key]
            victims.append((workload, [(p.namespace, p.name) for p in gang.pods], None))
        going = {p.key for facts in self.world.pods.values() for p in facts if p.deleting}
        victims = [  # a gang whose pods already go frees their cards without being asked again
            (w, live, kept)
            for w, pods_of, kept in victims
            if (live := [p for p in pods_of if f"{p[0]}/{p[1]}" not in going])
        ]
        if not victims:
            return False
        doomed = [pod for _, pods_of, _ in victims for pod in pods_of]
        await self.act.annotate(doomed, {labels.CHECKPOINT_REQUEST: request_id})
        for workload, pods_of, kept in victims:
            grace = self.checkpoint_grace(workload)
            if grace is None:
                record = trainingjob.Preemption(
                    by=by,
                    priority=priority,
                    request_id=request_id,
                    evicted_at=clock.SYSTEM.now(),
                    replicas_kept=kept,
                    checkpoint=trainingjob.PreemptionCheckpoint.NOT_ASKED,
                    step=_newest(workload),
                )
                await self.give_up(workload, pods_of, record, "")
                continue
            self.world.decisions.preempting[workload.uid] = decisions.Preempting(
                request_id,
                by,
                priority,
                clock.SYSTEM.now(),
                grace,
                _newest(workload),
                tuple(pods_of),
                kept,
            )
            self.event(
                workload,
                "Normal",
                "CheckpointRequested",
                f"preempted by {by} (priority {priority}): checkpoint asked before giving up "
                f"{len(pods_of)} pods (request {request_id}, grace {grace:g} s)",
            )
        metrics.PREEMPTIONS.labels("shrink").inc(len(plan.shrink))
        metrics.PREEMPTIONS.labels("evict").inc(len(plan.evict))
        self.event(
            item.workload,
            "Normal",
            "Preempting",
            f"gang {by} takes cards from "
            f"{len(plan.shrink)} shrunk and {len(plan.evict)} evicted gang(s)",
        )
        log.info(
            "preempting",
            gang=by,
            shrink=dict(plan.shrink),
            evict=list(plan.evict),
            checkpoint_request=request_id,
        )
        return True

    def checkpoint_grace(self, workload: Workload) -> float | None:
        """Seconds a victim gets to checkpoint: None (at once) for inference and for training
        that saves no checkpoint or has no pod running; else its own
        ``spec.checkpoint.graceSeconds``, its SuperNode's ``timeSharing.checkpointGraceSeconds``,
        or :data:`DEFAULT_GRACE_SECONDS`."""
        if not isinstance(workload.model, trainingjob.TrainingJob):
            return None
        tiers = workload.model.spec.checkpoint
        if not (tiers.memory or tiers.local or tiers.persistent):
            return None
        if not any(p.phase == "Running" for p in self.world.pods.get(workload.key, [])):
            return None
        if tiers.grace_seconds is not None:
            return float(tiers.grace_seconds)
        sn = self.world.supernodes.get(workload.model.spec.super_node or "")
        sharing = sn.spec.time_sharing if sn is not None else None
        return float(sharing.checkpoint_grace_seconds) if sharing else DEFAULT_GRACE_SECONDS

    async def finish_preemptions(self) -> None:
        """Phase 4b: victims asked to checkpoint give up their pods once they answered or their
        grace is over; the daemons are asked in the background (handlers.background)."""
        decisions = self.world.decisions
        by_uid = {w.uid: w for w in self.world.workloads}
        for uid, asked in list(decisions.preempting.items()):
            workload = by_uid.get(uid)
            if workload is None:
                del decisions.preempting[uid]
                continue
            at, step = self.memory.answers.get(uid, (float("-inf"), None))
            now = clock.SYSTEM.monotonic()
            if now - at >= CHECK_SECONDS:
                self.memory.tasks.start(uid, self.check(workload, now))
            real = clock.SYSTEM.now()
            if not transition.released(asked.baseline, step, asked.requested_at, asked.grace, real):
                continue
            answered = transition.answered(asked.baseline, step)
            waited = (real - asked.requested_at).total_seconds()
            how = (
                f"checkpoint answered at step {step} in {waited:.1f} s"
                if answered
                else f"checkpoint not answered within {asked.grace:g} s (newest step {step})"
            )
            del decisions.preempting[uid]
            self.memory.answers.pop(uid, None)
            record = trainingjob.Preemption(
                by=asked.by,
                priority=asked.priority,
                request_id=asked.request,
                requested_at=asked.requested_at,
                evicted_at=real,
                replicas_kept=asked.keep,
                checkpoint=trainingjob.PreemptionCheckpoint.ANSWERED
                if answered
                else trainingjob.PreemptionCheckpoint.GRACE_EXPIRED,
                step=step,
                checkpoint_seconds=round(max(waited, 0.0), 3),
            )
            await self.give_up(workload, list(asked.doomed), record, how)

    async def check(self, workload: Workload, at: float) -> None:
        """The newest step every rank of a preempted job committed, on the daemons of its
        nodes (and its tier 3): whether it answered."""
        assert isinstance(workload.model, trainingjob.TrainingJob)
        _, known = self.memory.answers.get(workload.uid, (at, None))
        self.memory.answers[workload.uid] = (at, known)  # asked: not again too soon
        nodes = {str(n.name): n.endpoint for n in self.world.nodes if n.endpoint}
        endpoints = {
            p.node: nodes[p.node]
            for p in self.world.pods.get(workload.key, [])
            if p.node and p.node in nodes
        }
        persistent = workload.model.spec.checkpoint.persistent
        found = await self.act.inventory(
            workload.uid, endpoints, persistent.uri if persistent else None
        )
        size = read_model.replicas_now(self.world, workload)
        self.memory.answers[workload.uid] = (at, found.newest_complete(size))

    async def give_up(
        self,
        workload: Workload,
        doomed: list[tuple[str, str]],
        record: trainingjob.Preemption,
        how: str,
    ) -> None:
        """A victim's pods go: an elastic gang shrinks to ``record.replicas_kept`` replicas,
        else the whole gang is evicted (condition Preempted, which says whether it
        checkpointed); a TrainingJob's ``status.preemptions`` gets ``record``."""
        why = f"for {record.by} (priority {record.priority})" + (f"; {how}" if how else "")
        keep = record.replicas_kept
        extra: dict[str, Any] = {}
        if workload.kind == trainingjob.KIND:
            history = [*self.preemptions_of(workload), common.to_wire(record)]
            history = history[-trainingjob.KEPT_PREEMPTIONS :]
            self.memory.preemptions[workload.uid] = history
            extra["preemptions"] = history
        if keep is not None:
            await self.set_replicas(workload, keep, extra)
            self.event(workload, "Warning", "Shrunk", f"shrunk to {keep} replicas {why}")
        else:
            self.memory.statuses.pop(workload.uid, None)
            await self.mark_preempted(workload, f"evicted {why}", extra)
        await self.act.delete_pods(doomed)
        live = {p.key: p for facts in self.world.pods.values() for p in facts}
        for namespace, name in doomed:
            if (pod := live.get(f"{namespace}/{name}")) is not None:
                self.assumed.deleting(pod)
        self.preempted = True

    def event(self, workload: Workload, kind: str, reason: str, message: str) -> None:
        self.act.event(workload.ref, kind, reason, message)

    def effective(self, workload: Workload) -> int:
        return read_model.replicas_now(self.world, workload)

    async def set_replicas(
        self, workload: Workload, replicas: int, extra: Mapping[str, Any] | None = None
    ) -> None:
        self.world.decisions.replicas[workload.uid] = replicas
        await self.act.patch_status(
            trainingjob.PLURAL,
            workload.namespace,
            workload.name,
            {"replicas": {"desired": replicas}, **(extra or {})},
        )

    def preemptions_of(self, workload: Workload) -> list[dict[str, Any]]:
        """status.preemptions as this cycle last wrote them, else as the index shows them."""
        remembered = self.memory.preemptions.get(workload.uid)
        if remembered is not None:
            return [dict(p) for p in remembered]
        return [dict(p) for p in workload.status.get("preemptions") or []]

    async def mark_preempted(
        self, workload: Workload, message: str, extra: Mapping[str, Any] | None = None
    ) -> None:
        plural = (
            trainingjob.PLURAL if workload.kind == trainingjob.KIND else inferenceservice.PLURAL
        )
        condition = _condition("Preempted", True, "Preempted", message[:32768], workload)
        conditions = common.set_condition(self.conditions_of(workload), condition)
        wire = [common.to_wire(c) for c in conditions]
        self.memory.conditions[workload.uid] = wire
        await self.act.patch_status(
            plural, workload.namespace, workload.name, {"conditions": wire, **(extra or {})}
        )
        self.event(workload, "Warning", "Preempted", condition.message)

    def conditions_of(self, workload: Workload) -> list[common.Condition]:
        """The workload's conditions as this cycle last wrote them, else as the index shows."""
        remembered = self.memory.conditions.get(workload.uid)
        return _conditions({"conditions": remembered} if remembered else workload.status)

    # ---- phase 6: reserve, then bind -----------------------------------------------------------

    async def bind(self, bindings: Sequence[Binding]) -> list[Binding]:
        """Each gang at once, on its own: reserve every pod (a new gang's pods are created
        reserved), then bind them if every reservation took; the bindings that went through.
        A gang does not wait for the others' reservations before its Bindings go out. What
        was written is assumed held (handlers.world)."""
        if not bindings:
            return []
        started = clock.SYSTEM.monotonic()
        pods_bound = await asyncio.gather(*(self.bind_gang(b) for b in bindings))
        failed = {b.placement.gang for b, n in zip(bindings, pods_bound, strict=True) if n is None}
        reservations = [b.placement.assignments for b in bindings]
        done = [b for b in bindings if b.placement.gang not in failed]
        elapsed = clock.SYSTEM.monotonic() - started
        metrics.BIND_SECONDS.observe(elapsed)
        metrics.BOUND_PODS.inc(sum(n for n in pods_bound if n is not None))
        for b in done:
            nodes = {a.node for a in b.placement.assignments}
            where = sorted({self.supernode_of.get(n, "?") for n in nodes})
            self.event(
                b.pending.workload,
                "Normal",
                "Scheduled",
                f"gang {b.placement.gang}: {len(b.placement.assignments)} pods bound on "
                f"{len(nodes)} nodes of {', '.join(where)} in {elapsed:.2f} s",
            )
        log.info(
            "bound gangs",
            gangs=len(done),
            failed=len(failed),
            pods=sum(len(r) for r in reservations),
            seconds=round(elapsed, 3),
        )
        return done

    async def bind_gang(self, b: Binding) -> int | None:
        """Reserve, then bind, one gang's pods; how many were bound, or None if the gang
        failed (a reservation or a Binding refused: the next cycle finishes or undoes it)."""
        key = b.placement.gang
        if b.pending.new is not None:
            [(_, made)] = await self.create_reserved([b])
            if made is None:
                return None
            reservations = made
        else:
            reservations = self.unbound(b)
            for pod, node, cards in reservations:
                self.assumed.reserved(pod, node, cards)
            outcomes = await self.act.reserve(
                [(p.namespace, p.name, n, labels.format_cards(c)) for p, n, c in reservations]
            )
            refused = False
            for (pod, _, _), outcome in zip(reservations, outcomes, strict=True):
                if outcome is not None:
                    self.assumed.released(pod)
                    refused = True
                    log.warning("could not reserve", pod=pod.key, error=str(outcome))
                    self.refused(b.pending.workload, key, "reserve", outcome)
            if refused:
                return None
        bound = await self.act.bind([(p.namespace, p.name, n) for p, n, _ in reservations])
        ok = True
        for (pod, node, cards), outcome in zip(reservations, bound, strict=True):
            if not self.bound(pod, node, cards, outcome):
                ok = False
                self.refused(b.pending.workload, key, "bind", outcome)
        return len(reservations) if ok else None

    async def create_reserved(
        self, bindings: Sequence[Binding]
    ) -> list[tuple[Binding, list[tuple[convert.PodFacts, str, frozenset[int]]] | None]]:
        """Create the pods of new gangs with their reservation; per gang (pod, node, cards) of
        each, or None if one could not be created (its created pods are then a partial
        reservation: the next cycle clears it and places the gang again)."""
        manifests: list[dict[str, Any]] = []
        owners: list[tuple[Binding, str, frozenset[int]]] = []
        rest: list[dict[str, Any]] = []  # pods the placement gives no card: created unreserved
        for b in bindings:
            assert b.pending.new is not None
            chosen = {a.pod.split("/", 1)[1]: a for a in b.placement.assignments}
            for name, manifest in b.pending.new.items():
                a = chosen.get(name)
                if a is None:
                    rest.append(manifest)
                    continue
                body = copy.deepcopy(manifest)
                notes = body["metadata"].setdefault("annotations", {})
                notes[convert.NODE_ANNOTATION] = a.node
                notes[labels.CARDS] = labels.format_cards(frozenset(a.cards))
                manifests.append(body)
                owners.append((b, a.node, frozenset(a.cards)))
        answers = await self.act.create_reserved(manifests) if manifests else []
        made: dict[model.GangKey, list[tuple[convert.PodFacts, str, frozenset[int]]] | None] = {
            b.placement.gang: [] for b in bindings
        }
        for (b, node, cards), (facts, outcome) in zip(owners, answers, strict=True):
            key = b.placement.gang
            if facts is None:
                log.warning("could not create a reserved pod", gang=key, error=str(outcome))
                self.refused(b.pending.workload, key, "create", outcome)
                made[key] = None
                continue
            self.assumed.made(facts)
            self.world.pods.setdefault(f"{facts.namespace}/{facts.owner}", []).append(facts)
            gang_made = made[key]
            if gang_made is not None:
                gang_made.append((facts, node, cards))
        if rest:
            await self.act.create_pods(rest)
        return [(b, made[b.placement.gang]) for b in bindings]

    async def create_unplaced(self, tried: set[model.GangKey]) -> None:
        """New gangs that could not be placed this cycle get their pods now, unreserved: the
        pods show the gang waiting (kubectl get pods), and the next cycles place them."""
        manifests = [
            m for p in self.new if p.gang.request.gang not in tried for m in (p.new or {}).values()
        ]
        if manifests:
            try:
                await self.act.create_pods(manifests)
            except Exception as error:  # e.g. a namespace being deleted: next cycle again
                log.warning("could not create pods", pods=len(manifests), error=str(error))

    @staticmethod
    def unbound(
        binding: Binding,
    ) -> list[tuple[convert.PodFacts, str, frozenset[int]]]:
        """(pod, node, cards) of every pod of the gang that the placement gives cards."""
        facts = {p.key: p for p in binding.pending.pods}
        return [
            (facts[a.pod], a.node, frozenset(a.cards))
            for a in binding.placement.assignments
            if a.pod in facts and not facts[a.pod].node
        ]

    def refused(
        self, workload: Workload, key: model.GangKey, step: str, outcome: pods.Outcome
    ) -> None:
        """A reservation or Binding the API server refused for RBAC (403): the gang's
        Scheduled condition and a Warning Event say so, with the API server's words (the
        operator's ServiceAccount lacks a rule of the chart's ClusterRole), and an error is
        logged. Other failures are retried quietly by the next cycle."""
        message = k8s_client.forbidden(outcome) if outcome is not None else None
        if message is None:
            return
        reason = model.Reason(
            FORBIDDEN,
            f"the API server refused to {step} its pods: {message} (the operator's "
            "ServiceAccount lacks a rule of the chart's ClusterRole)",
        )
        if self.memory.reasons.get(key) != reason:
            log.error("forbidden by RBAC", gang=key, step=step, message=message)
            self.event(workload, "Warning", reason.code, f"gang {key}: {reason.message}")
        self.memory.reasons[key] = reason

    def bound(
        self, pod: convert.PodFacts, node: str, cards: frozenset[int], outcome: pods.Outcome
    ) -> bool:
        """Remember a Binding that went through; a failed one leaves the reservation (the next
        cycle finishes it), one bound elsewhere leaves it to the index."""
        if outcome is None:
            self.assumed.bound(pod, node, cards)
            return True
        if isinstance(outcome, pods.BoundElsewhereError):
            self.assumed.released(pod)
        log.warning("could not bind", pod=pod.key, node=node, error=str(outcome))
        return False

    # ---- phase 7: status -------------------------------------------------------------------------

    async def report(
        self, wanted: Mapping[str, list[gangs.Gang]], bindings: Sequence[Binding]
    ) -> None:
        just_bound = {a.pod: a for b in bindings for a in b.placement.assignments}
        changed: list[tuple[Workload, str, dict[str, Any]]] = []
        for workload in self.world.workloads:
            if workload.model is None:
                continue
            facts = self.world.pods.get(workload.key, [])
            plans = wanted.get(workload.key, [])
            if isinstance(workload.model, trainingjob.TrainingJob):
                status = training_status(
                    workload,
                    plans,
                    facts,
                    just_bound,
                    self.memory.reasons,
                    self.supernode_of,
                    self.world,
                    self.conditions_of(workload),
                    self.preemptions_of(workload),
                )
                if "preemptions" in status:
                    self.memory.preemptions[workload.uid] = status["preemptions"]
                status = self.shares.amend(workload.key, status)  # time-sharing phase, desired
                plural = trainingjob.PLURAL
            else:
                status = await self.inference_status(workload, plans, facts, just_bound)
                plural = inferenceservice.PLURAL
            self.memory.conditions[workload.uid] = status["conditions"]
            if self.memory.statuses.get(workload.uid) != status:
                changed.append((workload, plural, status))
        await self.write_statuses(changed)

    async def write_statuses(self, changed: Sequence[tuple[Workload, str, dict[str, Any]]]) -> None:
        """Patch these statuses concurrently (after a burst, hundreds of jobs have a new one;
        one at a time they kept the loop for seconds). One that fails is written next cycle."""
        semaphore = asyncio.Semaphore(pods.CONCURRENCY)

        async def write(workload: Workload, plural: str, status: dict[str, Any]) -> None:
            async with semaphore:
                await self.act.patch_status(plural, workload.namespace, workload.name, status)

        results = await asyncio.gather(*(write(*c) for c in changed), return_exceptions=True)
        for (workload, _, status), result in zip(changed, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result  # cancelled: the loop is stopping
                log.warning("could not write a status", workload=workload.key, error=str(result))
            else:
                self.memory.statuses[workload.uid] = status

    async def inference_status(
        self,
        workload: Workload,
        plans: list[gangs.Gang],
        facts: list[convert.PodFacts],
        just_bound: Mapping[model.PodKey, model.Assignment],
    ) -> dict[str, Any]:
        assert isinstance(workload.model, inferenceservice.InferenceService)
        spec = workload.model.spec
        by_name = {p.name: p for p in facts}
        kv = self.kv.get(workload.uid)
        waiting = (  # a service waiting for the KV pool has no gangs: show what it wants
            {r.name: r.replicas for r in workload.served_spec().roles}
            if isinstance(kv, kv_pool.Waiting)
            else {}
        )
        roles = []
        for role in spec.roles:
            role_gangs = [g for g in plans if g.role == role.name]
            ready = sum(
                1
                for g in role_gangs
                if all(by_name.get(p.name) and by_name[p.name].ready for p in g.pods)
            )
            wanted = waiting.get(role.name, len(role_gangs))
            roles.append(inferenceservice.RoleStatus(name=role.name, replicas=wanted, ready=ready))
        expert_map = await self.write_expert_map(workload, plans, by_name, just_bound)
        all_pods = [p for g in plans for p in g.pods]
        bound = [_placed(p, by_name, just_bound) for p in all_pods]
        placed = [b for b in bound if b is not None]
        complete = len(placed) == len(all_pods) and bool(all_pods)
        reason = self.first_reason(plans)
        if isinstance(kv, kv_pool.Waiting):
            reason = model.Reason(kv.reason.value, kv.message)
        condition = _condition(
            "Ready",
            complete and all(r.ready == r.replicas for r in roles),
            "AllReplicasReady" if complete else (reason.code if reason else "Scheduling"),
            (
                f"{len(placed)}/{len(all_pods)} pods bound"
                if complete or not reason
                else reason.message
            ),
            workload,
        )
        self.tell_kv(workload, kv)
        status: dict[str, Any] = {
            "observedGeneration": workload.generation,
            "roles": [common.to_wire(r) for r in roles],
            "roleSummary": inferenceservice.summarize_roles(roles),
            "placement": _placement_summary(placed, self.supernode_of),
            "conditions": [
                common.to_wire(c)
                for c in common.set_condition(self.conditions_of(workload), condition)
            ],
        }
        if expert_map:
            status["expertMap"] = expert_map
        if kv is not None:
            status["kvCache"] = kv_status(kv, self.world)
        return status

    def tell_kv(self, workload: Workload, kv: kv_pool.Decision | None) -> None:
        """An Event when the service's KV-cache admission changes: reserved, or why it waits."""
        if kv is None:
            return
        told = "Reserved" if isinstance(kv, kv_pool.Admitted) else kv.reason.value
        if self.memory.kv_reasons.get(workload.uid) == told:
            return
        self.memory.kv_reasons[workload.uid] = told
        if isinstance(kv, kv_pool.Admitted):
            message = (
                f"reserved {kv_pool.human(kv.bytes)} in the KV-cache pool of SuperNode"
                f" {kv.super_node!r}: {kv_pool.human(kv.quota_bytes)} on each member node"
            )
            self.event(workload, "Normal", "KVCacheReserved", message)
        else:
            self.event(workload, "Warning", kv.reason.value, kv.message)

    async def write_expert_map(
        self,
        workload: Workload,
        plans: list[gangs.Gang],
        by_name: Mapping[str, convert.PodFacts],
        just_bound: Mapping[model.PodKey, model.Assignment],
    ) -> str | None:
        assert isinstance(workload.model, inferenceservice.InferenceService)
        ep_roles = {r.name: r for r in workload.model.spec.roles if r.expert_parallel}
        if not ep_roles:
            return None
        name = f"{workload.name}-expert-map"
        data: dict[str, str] = {}
        for gang in plans:
            role = ep_roles.get(gang.role)
            placed = [_placed(p, by_name, just_bound) for p in gang.pods]
            if role is None or any(p is None for p in placed):
                continue
            cards = {
                p.name: tuple(sorted(pl[1]))
                for p, pl in zip(gang.pods, placed, strict=True)
                if pl is not None
            }
            mapping = gangs.expert_map(role, cards, [p.name for p in gang.pods])
            replica = gang.pods[0].replica
            data[f"{role.name}-{replica}.json"] = json.dumps(mapping, separators=(",", ":"))
        content = json.dumps(data, sort_keys=True)
        if data and self.memory.expert_maps.get(workload.uid) != content:
            await self.act.apply_configmap(workload.namespace, name, data, workload.ref)
            self.memory.expert_maps[workload.uid] = content
        return name if data else None

    def first_reason(self, plans: Iterable[gangs.Gang]) -> model.Reason | None:
        return next(
            (
                self.memory.reasons[g.request.gang]
                for g in plans
                if g.request.gang in self.memory.reasons
            ),
            None,
        )


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


def gang_state(present: Sequence[convert.PodFacts]) -> str:
    """bound | reserved (all chosen, binding unfinished) | partial (a reservation interrupted)
    | holed (some pods bound, others new) | unplaced."""
    if all(p.node for p in present):
        return "bound"
    if all(p.node or (p.reserved_node and p.cards) for p in present):
        return "reserved"
    if any(p.reserved_node and not p.node for p in present):
        return "partial"
    if any(p.node for p in present):
        return "holed"
    return "unplaced"


def training_contracts(
    workload: Workload, wanted: Sequence[gangs.Gang], existing: Mapping[str, convert.PodFacts]
) -> dict[str, pods.TrainingContract]:
    """Per pod name, what a new pod of a TrainingJob is told (``pods.TrainingContract``); {}
    for other kinds. A new rank joins the run its gang's live pods are in (the newest one
    their incarnation or restore annotations name: a rank added by elastic growth); a gang
    with none starts a new run, numbered by the time in milliseconds so that it is newer
    than every recovery before it. (A rank told to restore runs as the incarnation its
    restore annotation names instead.)"""
    if not isinstance(workload.model, trainingjob.TrainingJob):
        return {}
    live = [p for p in existing.values() if not p.deleting]
    incarnation = max((_incarnation_of(p) for p in live), default=0)
    if not incarnation:
        incarnation = int(clock.SYSTEM.now().timestamp() * 1000)
    checkpoint = common.to_wire(workload.model.spec.checkpoint)
    checkpoint.pop("graceSeconds", None)  # the operator's business, not the trainer's
    port, memory_path, persistent_root = pods.daemon_settings()
    persistent = workload.model.spec.checkpoint.persistent
    inside = persistent is not None and _inside(persistent.uri, persistent_root)
    credential = (
        daemons.secret() is not None
    )  # then the job's Secret is written (handlers.credentials)
    return {
        plan.name: pods.TrainingContract(
            job_uid=workload.uid,
            world_size=len(gang.pods),
            incarnation=incarnation,
            checkpoint=json.dumps(checkpoint, sort_keys=True),
            daemon_port=port,
            memory_path=memory_path,
            persistent_path=persistent_root if inside else "",
            credential=credential,
        )
        for gang in wanted
        for plan in gang.pods
    }


def _inside(uri: str, root: str) -> bool:
    """Whether a ``file://`` URI lies in the folder ``root``."""
    if not uri.startswith("file://"):
        return False
    path = posixpath.normpath(uri.removeprefix("file://"))
    return path == root.rstrip("/") or path.startswith(root.rstrip("/") + "/")


def _incarnation_of(pod: convert.PodFacts) -> int:
    try:
        asked = restore_codec.parse_restore(pod.restore)
    except ValueError:
        asked = None
    named = asked.incarnation if asked is not None and asked.incarnation is not None else 0
    return max(pod.incarnation, named)


def pin(
    pod: dict[str, Any], recovery: decisions.RecoveryPlan | None, resume: str | None = None
) -> dict[str, Any]:
    """A new pod of a recovering job: reserved on its target node and cards (InPlace,
    SpareSwap; the normal binding path finishes it) and told what to restore. A new pod of a
    job evicted by a preemption restores ``resume``, the step it checkpointed when asked."""
    if resume and not recovery:
        pod["metadata"].setdefault("annotations", {})[labels.RESTORE] = resume
    if not recovery:
        return pod
    rank = pod["metadata"]["labels"][labels.RANK]
    annotations = pod["metadata"].setdefault("annotations", {})
    restore = recovery.restore_for(int(rank))
    if restore:
        annotations[labels.RESTORE] = restore
    target = recovery.target(int(rank))
    if target is not None:
        annotations[convert.NODE_ANNOTATION], annotations[labels.CARDS] = target
    return pod


def training_status(
    workload: Workload,
    plans: list[gangs.Gang],
    facts: list[convert.PodFacts],
    just_bound: Mapping[model.PodKey, model.Assignment],
    reasons: Mapping[str, model.Reason],
    supernode_of: Mapping[str, str],
    world: World,
    conditions_now: Sequence[common.Condition] | None = None,
    preemptions: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    current = list(conditions_now) if conditions_now is not None else _conditions(workload.status)
    if read_model.succeeded(world, workload):
        return lifecycle.finished_status(workload, world, current)
    by_name = {p.name: p for p in facts}
    all_pods = [p for g in plans for p in g.pods]
    placed = [b for p in all_pods if (b := _placed(p, by_name, just_bound)) is not None]
    running = sum(1 for p in all_pods if p.name in by_name and by_name[p.name].phase == "Running")
    done = sum(1 for p in all_pods if p.name in by_name and by_name[p.name].phase == "Succeeded")
    preempted = common.find_condition(current, "Preempted")
    complete = bool(all_pods) and len(placed) == len(all_pods)
    if read_model.failed_reason(world, workload) is not None:
        phase = trainingjob.Phase.FAILED
    elif read_model.recovery_of(world, workload):
        phase = trainingjob.Phase.RECOVERING
    elif workload.uid in world.decisions.preempting:
        phase = trainingjob.Phase.CHECKPOINTING  # preempted, asked to checkpoint first
    elif complete:
        phase = (  # ranks that finished first leave the job Running
            trainingjob.Phase.RUNNING
            if running and running + done == len(all_pods)
            else trainingjob.Phase.SCHEDULED
        )
    elif preempted is not None and preempted.status == common.ConditionStatus.TRUE:
        phase = trainingjob.Phase.SUSPENDED
    else:
        phase = trainingjob.Phase.PENDING
    reason = next((reasons[g.request.gang] for g in plans if g.request.gang in reasons), None)
    scheduled = _condition(
        "Scheduled",
        complete,
        "GangBound" if complete else (reason.code if reason else "Waiting"),
        f"{len(placed)}/{len(all_pods)} pods bound" if complete or not reason else reason.message,
        workload,
    )
    conditions = common.set_condition(current, scheduled)
    if workload.uid in world.decisions.failed:  # the index may not show the Failed condition
        code, message = world.decisions.failed[workload.uid]
        conditions = common.set_condition(
            conditions, _condition("Failed", True, code, message[:32768], workload)
        )
    if complete and preempted is not None:
        conditions = common.set_condition(
            conditions,
            _condition("Preempted", False, "Resumed", "the gang is bound again", workload),
        )
    status = {
        "observedGeneration": workload.generation,
        "phase": phase.value,
        "replicas": {
            "desired": read_model.replicas_now(world, workload),
            "bound": len(placed),
            "running": running,
        },
        "placement": _placement_summary(placed, supernode_of),
        "conditions": [common.to_wire(c) for c in conditions],
    }
    if preemptions:
        status["preemptions"] = (
            resumed(preemptions, facts) if complete else [dict(p) for p in preemptions]
        )
    return status


def resumed(
    preemptions: Sequence[Mapping[str, Any]], facts: Sequence[convert.PodFacts]
) -> list[dict[str, Any]]:
    """status.preemptions once the gang is bound again: the newest eviction (not a shrink) is
    closed with when, and the step the new pods were told to restore."""
    history = [dict(p) for p in preemptions]
    last = history[-1]
    if last.get("resumedAt") or last.get("replicasKept") is not None:
        return history
    steps = set()
    for pod in facts:
        try:
            told = restore_codec.parse_restore(pod.restore)
        except ValueError:
            continue
        if told is not None and told.step is not None:
            steps.add(told.step)
    last["resumedAt"] = clock.SYSTEM.now().isoformat().replace("+00:00", "Z")
    if len(steps) == 1:
        last["restoredStep"] = steps.pop()
    return history


def _placed(
    plan: gangs.PodPlan,
    by_name: Mapping[str, convert.PodFacts],
    just_bound: Mapping[model.PodKey, model.Assignment],
) -> tuple[str, frozenset[int]] | None:
    """(node, cards) of a pod that is bound and stays, or being bound in this cycle."""
    if plan.key in just_bound:
        a = just_bound[plan.key]
        return a.node, frozenset(a.cards)
    facts = by_name.get(plan.name)
    if facts and facts.node and facts.cards and not facts.deleting:
        return facts.node, facts.cards
    return None


def _placement_summary(
    placed: Sequence[tuple[str, frozenset[int]]], supernode_of: Mapping[str, str]
) -> dict[str, Any]:
    nodes = sorted({node for node, _ in placed})
    supernodes = sorted({supernode_of[n] for n in nodes if n in supernode_of})
    return common.to_wire(
        common.PlacementStatus(
            super_node=supernodes[0] if supernodes else None,
            super_nodes=supernodes,
            nodes=nodes,
            cards=sum(len(c) for _, c in placed),
        )
    )


def kv_admission(world: World, memory: Memory) -> dict[str, kv_pool.Decision]:
    """Every InferenceService with spec.kvCache: admitted to its SuperNode's KV-cache pool or
    waiting (:func:`matrixpool.serving.pool.admit`). A service whose status (as this operator
    last wrote it, else as the index shows it) says admitted keeps its place."""
    members = read_model.members(world)
    pools = {
        name: kv_pool.Pool(
            name,
            len(members.get(name, ())),
            sn.spec.memory_pool.per_node_bytes if sn.spec.memory_pool else 0,
        )
        for name, sn in world.supernodes.items()
    }
    claims = []
    for workload in world.workloads:
        service = workload.model
        if not isinstance(service, inferenceservice.InferenceService):
            continue
        spec = service.spec
        if spec.kv_cache is None or spec.super_node is None:
            continue
        status = memory.statuses.get(workload.uid) or workload.status
        held = bool((status.get("kvCache") or {}).get("admitted"))
        claims.append(
            kv_pool.Claim(
                workload.uid,
                spec.super_node,
                spec.kv_cache.size,
                spec.priority,
                workload.created,
                held,
            )
        )
    decisions = kv_pool.admit(pools, claims) if claims else {}
    observe_kv(pools, claims, decisions)
    return decisions


def observe_kv(
    pools: Mapping[str, kv_pool.Pool],
    claims: Sequence[kv_pool.Claim],
    decisions: Mapping[str, kv_pool.Decision],
) -> None:
    """The pools' capacity and reservations, and the services admitted and waiting."""
    for name, found in pools.items():
        if found.per_node_bytes <= 0:
            continue
        mine = [c for c in claims if c.super_node == name]
        admitted = [decisions[c.uid] for c in mine]
        reserved = sum(d.bytes for d in admitted if isinstance(d, kv_pool.Admitted))
        metrics.KV_POOL_BYTES.labels(name, "capacity").set(found.capacity_bytes)
        metrics.KV_POOL_BYTES.labels(name, "reserved").set(reserved)
        held = sum(isinstance(d, kv_pool.Admitted) for d in admitted)
        metrics.KV_SERVICES.labels(name, "admitted").set(held)
        metrics.KV_SERVICES.labels(name, "waiting").set(len(mine) - held)


def kv_status(kv: kv_pool.Decision, world: World) -> dict[str, Any]:
    """status.kvCache of a service with spec.kvCache."""
    if isinstance(kv, kv_pool.Waiting):
        return {"admitted": False}
    return {
        "admitted": True,
        "reserved": kv_pool.quantity(kv.bytes),
        "quotaPerNode": kv_pool.quantity(kv.quota_bytes),
        "nodes": len(read_model.members(world).get(kv.super_node, ())),
    }


def _conditions(status: Mapping[str, Any]) -> list[common.Condition]:
    return [common.Condition.model_validate(c) for c in status.get("conditions") or []]


def _condition(
    type_: str, ok: bool, reason: str, message: str, workload: Workload
) -> common.Condition:
    return common.Condition(
        type=type_,
        status=common.ConditionStatus.TRUE if ok else common.ConditionStatus.FALSE,
        reason=reason,
        message=message,
        last_transition_time=clock.SYSTEM.now(),
        observed_generation=workload.generation,
    )


def _newest(workload: Workload) -> int | None:
    """The newest step status.checkpoints shows on any tier."""
    steps = [s for s in (workload.status.get("checkpoints") or {}).values() if isinstance(s, int)]
    return max(steps, default=None)


CARDS_BEING_FREED = model.Reason(
    "WaitingForEviction", "the pods of preempted gangs are terminating; their cards come next"
)
WAITING_FOR_CHECKPOINT = model.Reason(
    "WaitingForCheckpoint",
    "lower-priority training was asked to checkpoint before it gives up its cards",
)
FORBIDDEN = "Forbidden"  # the code of a gang whose reservation or Binding RBAC refused
