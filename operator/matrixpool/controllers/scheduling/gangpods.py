"""Phases 2 and 3 of the scheduling cycle: the gangs each workload wants (:func:`gangs_of`) and
their pods kept in existence (:func:`reconcile_pods`): missing ones created, surplus ones
deleted, a finished job's pods kept until its ttl (:func:`expire`). Also what a new pod is told:
its TrainingJob's contract (:func:`training_contracts`), a recovery's target and restore
(:func:`pin`), the step a job evicted by a preemption resumes from (:func:`resume_value`), the
KV-cache pool of a service (:func:`serving_contract`), the expert map of an expert-parallel
pod (:func:`experts_contract`).

Called by :mod:`.cycle`. A new gang (no pod yet) is handed on as a
:class:`.cyclestate.Pending` holding its manifests: placed, its pods are created reserved
(:mod:`.binding`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import structlog

from matrixpool import clock
from matrixpool.api import common, inferenceservice, labels, trainingjob
from matrixpool.controllers import lifecycle, ranktable
from matrixpool.controllers.scheduling import cyclestate, regroup
from matrixpool.k8s import convert, daemonclient, pods
from matrixpool.placement import gangs
from matrixpool.serving import pool as kv_pool
from matrixpool.state import decisions
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)


def gangs_of(cycle: cyclestate.CycleState, workload: Workload) -> list[gangs.Gang]:
    if isinstance(workload.model, trainingjob.TrainingJob):
        if read_model.failed_reason(cycle.world, workload) is not None:
            return []  # a failed job keeps no pods
        if read_model.succeeded(cycle.world, workload):
            return []  # finished: nothing to place (its pods stay: reconcile_pods)
        spec = workload.model.spec
        size = cycle.sizes.get(spec.super_node or "") or max(cycle.sizes.values(), default=0)
        replicas = cycle.effective(workload)
        if replicas == 0:
            return []  # suspended by a time-sharing window
        return [
            gangs.training_gang(
                workload.namespace,
                workload.name,
                spec,
                size,
                replicas,
                card_resource=cycle.card_resource(workload),
            )
        ]
    assert isinstance(workload.model, inferenceservice.InferenceService)
    if isinstance(cycle.kv.get(workload.uid), kv_pool.Waiting):
        return []  # its KV cache does not fit the pool: no pods until it does
    return gangs.inference_gangs(
        workload.namespace,
        workload.name,
        workload.served_spec(),
        replicas=cycle.shares.inference.get(workload.key),  # None: not time-shared
        card_resource=cycle.card_resource(workload),
    )


async def reconcile_pods(
    cycle: cyclestate.CycleState, wanted: Mapping[str, list[gangs.Gang]]
) -> None:
    for workload in cycle.world.workloads:
        if read_model.succeeded(cycle.world, workload):
            await expire(cycle, workload)  # kept for their logs until the ttl
            continue
        existing = {p.name: p for p in cycle.world.pods.get(workload.key, [])}
        plans = [p for g in wanted.get(workload.key, []) for p in g.pods]
        names = {p.name for p in plans}
        template_of = template(cycle, workload)
        resource = cycle.card_resource(workload)
        recovery = read_model.recovery_of(cycle.world, workload)
        if plans and not recovery and isinstance(workload.model, trainingjob.TrainingJob):
            live = [p for p in existing.values() if not p.deleting]
            old = read_model.disagreeing(live, len(plans))
            if old is not None:  # its ranks were made for another world: all are replaced
                try:
                    await regroup.start(cycle, workload, live, old, len(plans))
                except Exception as error:  # e.g. a namespace being deleted: the others go on
                    log.warning("could not regroup", workload=workload.key, error=str(error))
                continue
        strays = (
            set(strays_of(cycle, workload, existing.values()))
            if plans and not recovery and workload.key not in cycle.shares.resuming
            else set()
        )
        if strays:
            log.info("stray pods deleted", workload=workload.key, pods=sorted(strays))
        missing = [plan for plan in plans if plan.name not in existing]
        resume = resume_value(cycle, workload, existing) if missing and not recovery else ""
        if strays:
            resume = None  # the new gang is made whole once they are gone
        wanted_gangs = wanted.get(workload.key, [])
        making = [plan for plan in missing if resume is not None]  # None: restore not known
        build = Manifests(
            cycle, workload, template_of, resource, wanted_gangs, existing, recovery, resume
        )
        # A recovery's new pods come reserved on their targets; a resuming job's are told
        # what to restore by time-sharing before they are bound. A new gang's manifests are
        # made only once it is bound or created unplaced (most of a burst's gangs wait for
        # later cycles: at 64 supernodes, making theirs every cycle was a third of it).
        later: set[str] = set()
        if not recovery and workload.key not in cycle.shares.resuming:
            ready = {plan.name for plan in making}
            for gang in wanted_gangs:
                members = [p.name for p in gang.pods]
                if members and all(n in ready for n in members):  # none exists: new
                    new = Lazy(functools.partial(build.of, gang.pods))
                    cycle.new.append(cyclestate.Pending(workload, gang, [], new))
                    later.update(members)
        manifests = build.of([plan for plan in making if plan.name not in later])
        create = list(manifests.values())
        surplus = [
            p
            for p in existing.values()
            if (p.name not in names or p.name in strays) and not p.deleting
        ]
        try:
            if create:
                await cycle.act.create_pods(create)
            if surplus:
                await cycle.act.delete_pods([p.ref for p in surplus])
                for p in surplus:
                    cycle.assumed.deleting(p)
        except Exception as error:  # e.g. a namespace being deleted: the others go on
            log.warning("could not reconcile pods", workload=workload.key, error=str(error))


async def expire(cycle: cyclestate.CycleState, workload: Workload) -> None:
    """The pods of a finished job go once spec.ttlSecondsAfterFinished has passed."""
    going = lifecycle.expired(cycle.world, workload, clock.SYSTEM.now())
    if not going:
        return
    await cycle.act.delete_pods([p.ref for p in going])
    for p in going:
        cycle.assumed.deleting(p)
    cycle.event(workload, "Normal", "PodsDeleted", f"ttl passed: {len(going)} pods deleted")


def resume_value(
    cycle: cyclestate.CycleState, workload: Workload, existing: Mapping[str, convert.PodFacts]
) -> str | None:
    """What the new pods of a TrainingJob evicted by a preemption restore ("" when it was
    not evicted, or nothing was committed), or None while that is not known yet.

    Known once every old pod is gone (the trainers save until they stop) and the daemons
    of its SuperNode and its tier 3 have told the newest step committed for every rank
    then — asked in the background (:meth:`find_resume`), the answer read by a later
    cycle. The open ``status.preemptions`` record says the job must resume, so a restarted
    operator does the same; pods already told keep what they were told."""
    resuming = resume_of(cycle, workload)
    if resuming is None:
        return ""
    tag, world, fresh = resuming
    told = [p for p in existing.values() if restore_codec.restore_id(p.restore) == tag]
    if told:
        return told[0].restore
    cached = cycle.memory.resumes.get(workload.uid)
    if cached is not None and cached[0] == tag:
        return cached[1]
    if existing:
        return None  # the old pods are still going
    found = find_resume(cycle, workload, tag, world, fresh=fresh)
    cycle.memory.tasks.start(f"resume/{workload.uid}", found)
    return None


def resume_of(
    cycle: cyclestate.CycleState, workload: Workload
) -> tuple[str, int | None, bool] | None:
    """(tag, world, fresh) of the restore a TrainingJob's new pods are told while it regroups
    (the old world's newest step; fresh when none) or resumes after an eviction; else None."""
    if not isinstance(workload.model, trainingjob.TrainingJob):
        return None
    resize = regroup.open_resize(cycle, workload)
    if resize is not None:
        return regroup.tag(resize), int(resize.get("fromReplicas") or 0) or None, True
    opened = open_eviction(cycle, workload)
    if opened is not None:  # the newest step of the world it was evicted at, not of its size now
        world = int(opened.get("worldSize") or 0) or None
        return f"preempt-{opened.get('requestId') or ''}", world, False
    return None


def strays_of(
    cycle: cyclestate.CycleState, workload: Workload, existing: Iterable[convert.PodFacts]
) -> list[str]:
    """Names of a regrouping or evicted job's live pods that were not made for its new gang
    (told another restore, or none). The old gang's pods are deleted when it regroups or is
    evicted; a pod that a cycle made meanwhile from an index that lagged the API (it did
    not show pods it had just created) would otherwise hold the new gang back for good: its
    pods are made once every old one is gone."""
    resuming = resume_of(cycle, workload)
    if resuming is None:
        return []
    tag = resuming[0]
    return [
        p.name for p in existing if not p.deleting and restore_codec.restore_id(p.restore) != tag
    ]


def open_eviction(cycle: cyclestate.CycleState, workload: Workload) -> Mapping[str, Any] | None:
    """The newest preemption of a TrainingJob that evicted it whole and has not resumed."""
    if not isinstance(workload.model, trainingjob.TrainingJob):
        return None
    history = cycle.preemptions(workload)
    last = history[-1] if history else None
    if last is None or last.get("resumedAt") or last.get("replicasKept") is not None:
        return None
    return last


async def find_resume(
    cycle: cyclestate.CycleState,
    workload: Workload,
    tag: str,
    world: int | None = None,
    *,
    fresh: bool = False,
) -> None:
    """The restore value of an evicted or regrouped job's new pods (named ``tag``): the newest
    step every rank of ``world`` (default: the size it runs at now) committed (one
    incarnation) on its SuperNode's daemons or its tier 3. When there is none: "" (no
    restore), or with ``fresh`` a fresh start as a new incarnation, named ``tag``."""
    assert isinstance(workload.model, trainingjob.TrainingJob)
    spec = workload.model.spec
    tiers = spec.checkpoint
    value = ""
    runs = None  # what the daemons and tier 3 hold of the job
    if tiers.memory or tiers.local or tiers.persistent:
        home = spec.super_node
        endpoints = {
            str(n.name): n.endpoint
            for n in cycle.world.nodes
            if n.endpoint and (not home or cycle.supernode_of.get(str(n.name)) == home)
        }
        persistent = tiers.persistent.uri if tiers.persistent else None
        found = runs = await cycle.act.inventory(workload.uid, endpoints, persistent)
        now = read_model.replicas_now(cycle.world, workload)
        step = found.newest_complete(world or now)
        if step is not None:
            value = restore_codec.restore_value(
                step,
                found.holders(step),
                tag,
                incarnation=found.new_incarnation(clock.SYSTEM.now()),
                of=found.incarnation_of(step),
                world=world if world and world != now else None,
            )
    if not value and fresh:
        value = restore_codec.restore_value(
            None,
            recovery_id=tag,
            incarnation=runs.new_incarnation(clock.SYSTEM.now())
            if runs is not None
            else restore_codec.new_incarnation((), clock.SYSTEM.now()),
            fresh=True,
        )
    cycle.memory.resumes[workload.uid] = (tag, value)
    log.info("job resumes", job=workload.key, request=tag, restore=value or None)


def serving_contract(
    cycle: cyclestate.CycleState, workload: Workload
) -> pods.ServingContract | None:
    """The KV-cache pool's part of the pods of a service whose KV cache is admitted: the
    daemons of its SuperNode's member nodes (those announced now) and its token."""
    kv = cycle.kv.get(workload.uid)
    if not isinstance(kv, kv_pool.Admitted):
        return None
    members = read_model.members(cycle.world).get(kv.super_node, ())
    port, _, _ = pods.daemon_settings()
    return pods.ServingContract(
        service_uid=workload.uid,
        daemons=tuple(sorted({n.endpoint for n in members if n.endpoint})),
        daemon_port=port,
        credential=daemonclient.secret() is not None,  # then controllers.credentials writes it
    )


def experts_contract(workload: Workload, plan: gangs.PodPlan) -> pods.ExpertsContract | None:
    """The expert map of a pod of an expert-parallel role (its instance's file of the
    service's ConfigMap, which :mod:`.status` writes); None for any other pod."""
    if not isinstance(workload.model, inferenceservice.InferenceService):
        return None
    role = workload.model.spec.role(plan.role)
    if role is None or role.expert_parallel is None:
        return None
    return pods.ExpertsContract(
        config_map=labels.expert_map_config_map(workload.name),
        key=labels.expert_map_key(plan.role, plan.replica),
        experts=role.expert_parallel.experts,
    )


class Manifests:
    """How one workload's missing pods are made this cycle (what :func:`reconcile_pods`
    knows of it), for the pods made now and for a new gang's, made when it is bound."""

    def __init__(
        self,
        cycle: cyclestate.CycleState,
        workload: Workload,
        template_of: Any,
        resource: str,
        wanted: Sequence[gangs.Gang],
        existing: Mapping[str, convert.PodFacts],
        recovery: Any,
        resume: str | None,
    ) -> None:
        self.cycle, self.workload, self.template_of = cycle, workload, template_of
        self.resource, self.wanted, self.existing = resource, wanted, existing
        self.recovery, self.resume = recovery, resume

    @functools.cached_property
    def _contracts(self) -> dict[str, pods.TrainingContract]:
        """Once per workload and cycle, however many gangs are made from it (and one run's
        incarnation for all of them)."""
        return training_contracts(self.workload, self.wanted, self.existing, self.resource)

    @functools.cached_property
    def _serving(self) -> pods.ServingContract | None:
        return serving_contract(self.cycle, self.workload)

    def of(self, plans: Sequence[gangs.PodPlan]) -> dict[str, dict[str, Any]]:
        """The manifests of ``plans``, by pod name."""
        if not plans:
            return {}
        workload, resource = self.workload, self.resource
        contracts, serving = self._contracts, self._serving
        return {
            plan.name: pin(
                pods.manifest(
                    plan,
                    self.template_of(plan.role),
                    workload.ref,
                    resource,
                    contracts.get(plan.name),
                    serving,
                    experts_contract(workload, plan),
                ),
                self.recovery,
                self.resume,
            )
            for plan in plans
        }


class Lazy(Mapping[str, dict[str, Any]]):
    """A mapping made on its first read (a new gang's manifests: :class:`Manifests`)."""

    def __init__(self, make: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._make: Callable[[], dict[str, dict[str, Any]]] | None = make
        self._made: dict[str, dict[str, Any]] = {}

    def _items(self) -> dict[str, dict[str, Any]]:
        if self._make is not None:
            self._made, self._make = self._make(), None
        return self._made

    def __getitem__(self, name: str) -> dict[str, Any]:
        return self._items()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())


def template(cycle: cyclestate.CycleState, workload: Workload) -> Any:
    if isinstance(workload.model, trainingjob.TrainingJob):
        template = workload.model.spec.template
        return lambda role: template
    assert isinstance(workload.model, inferenceservice.InferenceService)
    roles = {r.name: r.template for r in workload.model.spec.roles}
    return lambda role: roles.get(role, {})


def training_contracts(
    workload: Workload,
    wanted: Sequence[gangs.Gang],
    existing: Mapping[str, convert.PodFacts],
    card_resource: str = "",
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
    port, memory_path, _ = pods.daemon_settings()
    credential = (
        daemonclient.secret() is not None
    )  # then the job's Secret is written (controllers.credentials)
    rendezvous = workload.model.spec.rendezvous
    domain = pods.cluster_domain()
    return {
        plan.name: pods.TrainingContract(
            job_uid=workload.uid,
            world_size=len(gang.pods),
            incarnation=incarnation,
            checkpoint=json.dumps(checkpoint, sort_keys=True),
            daemon_port=port,
            memory_path=memory_path,
            credential=credential,
            rendezvous=pods.Rendezvous(
                job=workload.name,
                namespace=workload.namespace,
                rank=plan.rank,
                replicas=len(gang.pods),
                port=rendezvous.port,
                procs_per_replica=rendezvous.procs_per_replica,
                domain=domain,
                rank_table=ranktable.wanted(card_resource),
                job_uid=workload.uid,
            ),
        )
        for gang in wanted
        for plan in gang.pods
    }


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
