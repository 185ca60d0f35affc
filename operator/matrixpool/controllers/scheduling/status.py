"""Phase 7 of the scheduling cycle: each workload's status composed once, from the world and
what this cycle bound (:func:`report`), and written where it changed. Also what the cycle last
wrote of ``conditions`` and ``preemptions`` (:func:`conditions_of`, ``CycleState.preemptions``),
which :mod:`.preemption` writes at a preemption too. Called by :mod:`.cycle`.

One writer per status field of a TrainingJob or InferenceService (merge patches of disjoint
fields cannot undo each other; each writer remembers what it wrote, so a lagging index never
makes it drop a condition):

=======================================================  ==================================
field                                                    writer
=======================================================  ==================================
``phase``, ``replicas``, ``placement``, ``conditions``,  this cycle (phase 7; ``replicas``,
``observedGeneration``, ``roles``, ``roleSummary``,      ``conditions`` and ``preemptions``
``expertMap``, ``preemptions``, ``completionTime``,      also at a preemption;
``resizes``                                              ``resizes`` at a regroup's start)
``recovering``, ``recoveries``, ``recoveryCount``,       :mod:`matrixpool.controllers.recovery`
``checkpoints``
``timeSharing``                                          :mod:`matrixpool.controllers.timeshare`
``experts``                                              :mod:`matrixpool.controllers.experts`
=======================================================  ==================================

The expert map's ConfigMap (``<service>-expert-map``, :func:`write_expert_map`) is written here
alone, once an instance's pods are bound, laid out as ``status.experts`` says
(:func:`expert_layouts`): the experts controller re-plans by writing that status, and the map
follows at the next cycle, also after an operator restart.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import structlog

from matrixpool import clock
from matrixpool.api import common, inferenceservice, labels, trainingjob
from matrixpool.controllers import lifecycle
from matrixpool.controllers.scheduling import cyclestate, kvadmission, regroup
from matrixpool.k8s import convert, pods
from matrixpool.placement import gangs, model
from matrixpool.serving import pool as kv_pool
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool.state.world import World
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)


async def report(
    cycle: cyclestate.CycleState,
    wanted: Mapping[str, list[gangs.Gang]],
    bindings: Sequence[cyclestate.Binding],
) -> None:
    just_bound = {a.pod: a for b in bindings for a in b.placement.assignments}
    changed: list[tuple[Workload, str, dict[str, Any]]] = []
    endpoints = {str(n.name): n.endpoint for n in cycle.world.nodes}  # "": no daemon announced
    for workload in cycle.world.workloads:
        if workload.model is None:
            continue
        facts = cycle.world.pods.get(workload.key, [])
        plans = wanted.get(workload.key, [])
        if isinstance(workload.model, trainingjob.TrainingJob):
            status = training_status(
                workload,
                plans,
                facts,
                just_bound,
                cycle.memory.reasons,
                cycle.supernode_of,
                cycle.world,
                conditions_of(cycle, workload),
                cycle.preemptions(workload),
                regroup.resizes_of(cycle, workload),
            )
            if "preemptions" in status:
                cycle.memory.preemptions[workload.uid] = status["preemptions"]
            if "resizes" in status:
                cycle.memory.resizes[workload.uid] = status["resizes"]
            status = cycle.shares.amend(workload.key, status)  # time-sharing phase, desired
            plural = trainingjob.PLURAL
        else:
            status = await inference_status(cycle, workload, plans, facts, just_bound)
            plural = inferenceservice.PLURAL
        status["conditions"] = notices(cycle, workload, facts, status["conditions"], endpoints)
        cycle.memory.conditions[workload.uid] = status["conditions"]
        if cycle.memory.statuses.get(workload.uid) != status:
            changed.append((workload, plural, status))
    await write_statuses(cycle, changed)


SUPERNODE = "SuperNode"  # condition: the SuperNode spec.superNode names exists (once it did not)
SUPERNODE_DELETED = "SuperNodeDeleted"
DAEMONS = "CheckpointDaemons"  # condition: every node of a checkpointing job has a daemon
NO_DAEMONS = "NoCheckpointDaemons"


def notices(
    cycle: cyclestate.CycleState,
    workload: Workload,
    facts: Sequence[convert.PodFacts],
    conditions: list[dict[str, Any]],
    endpoints: Mapping[str, str],
) -> list[dict[str, Any]]:
    """What would otherwise go unsaid about a running workload, as conditions (and a Warning
    Event when one turns False): its SuperNode was deleted under it (issue 32: it keeps its pods
    and cards, and leaves that SuperNode's time-sharing and the autoscaler's cap), or a
    checkpointing TrainingJob runs on nodes with no announced checkpoint daemon (its saves fail
    there). A condition is written only once it has been False."""
    held = sorted({p.node for p in facts if p.node and not p.deleting})
    if not held or workload.model is None:
        return conditions
    checks: list[tuple[str, bool, str, str]] = []  # (type, ok, reason when not, message)
    named = workload.model.spec.super_node
    if named is not None:
        gone = named not in cycle.world.supernodes
        message = (
            f"spec.superNode {named} was deleted while {len(held)} node(s) run its pods: they "
            "keep their nodes and cards, but the workload leaves its time-sharing windows and "
            f"the autoscaler's cap; new pods wait until a SuperNode {named} exists again"
            if gone
            else f"spec.superNode {named} exists"
        )
        checks.append((SUPERNODE, not gone, SUPERNODE_DELETED, message))
    if isinstance(workload.model, trainingjob.TrainingJob):
        wanted = workload.model.spec.checkpoint
        if wanted.memory or wanted.local or wanted.persistent:
            silent = [n for n in held if not endpoints.get(n)]
            message = (
                f"spec.checkpoint asks for tiers, but node(s) {', '.join(silent)} of its pods "
                "have no announced checkpoint daemon (the chart's checkpointDaemon.enabled, "
                "and its nodeSelector): saves of the ranks there fail"
                if silent
                else "every node of its pods has an announced checkpoint daemon"
            )
            checks.append((DAEMONS, not silent, NO_DAEMONS, message))
    written = {str(c.get("type")) for c in conditions}
    if all(ok and type_ not in written for type_, ok, _, _ in checks):
        return conditions  # nothing wrong now nor before: the conditions as they are
    now = _conditions({"conditions": conditions})
    for type_, ok, reason, message in checks:
        now = _notice(cycle, workload, now, type_, ok, reason, message)
    return [common.to_wire(c) for c in now]


def _notice(
    cycle: cyclestate.CycleState,
    workload: Workload,
    conditions: list[common.Condition],
    type_: str,
    ok: bool,
    reason: str,
    message: str,
) -> list[common.Condition]:
    old = common.find_condition(conditions, type_)
    if ok and old is None:
        return conditions  # nothing was ever wrong: no condition
    if ok:
        fixed = new_condition(type_, True, "Resolved", message, workload)
        return common.set_condition(conditions, fixed)
    if old is None or old.status != common.ConditionStatus.FALSE or old.message != message:
        cycle.event(workload, "Warning", reason, message)
    return common.set_condition(conditions, new_condition(type_, False, reason, message, workload))


async def write_statuses(
    cycle: cyclestate.CycleState, changed: Sequence[tuple[Workload, str, dict[str, Any]]]
) -> None:
    """Patch these statuses concurrently (after a burst, hundreds of jobs have a new one;
    one at a time they kept the loop for seconds). One that fails is written next cycle."""
    semaphore = asyncio.Semaphore(pods.CONCURRENCY)

    async def write(workload: Workload, plural: str, status: dict[str, Any]) -> None:
        async with semaphore:
            await cycle.act.patch_status(plural, workload.namespace, workload.name, status)

    results = await asyncio.gather(*(write(*c) for c in changed), return_exceptions=True)
    for (workload, _, status), result in zip(changed, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result  # cancelled: the loop is stopping
            log.warning("could not write a status", workload=workload.key, error=str(result))
        else:
            cycle.memory.statuses[workload.uid] = status


async def inference_status(
    cycle: cyclestate.CycleState,
    workload: Workload,
    plans: list[gangs.Gang],
    facts: list[convert.PodFacts],
    just_bound: Mapping[model.PodKey, model.Assignment],
) -> dict[str, Any]:
    assert isinstance(workload.model, inferenceservice.InferenceService)
    spec = workload.model.spec
    by_name = {p.name: p for p in facts}
    kv = cycle.kv.get(workload.uid)
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
    expert_map = await write_expert_map(cycle, workload, plans, by_name, just_bound)
    all_pods = [p for g in plans for p in g.pods]
    bound = [_placed(p, by_name, just_bound) for p in all_pods]
    placed = [b for b in bound if b is not None]
    complete = len(placed) == len(all_pods) and bool(all_pods)
    reason = first_reason(cycle, plans)
    if isinstance(kv, kv_pool.Waiting):
        reason = model.Reason(kv.reason.value, kv.message)
    condition = new_condition(
        "Ready",
        complete and all(r.ready == r.replicas for r in roles),
        "AllReplicasReady" if complete else (reason.code if reason else "Scheduling"),
        (f"{len(placed)}/{len(all_pods)} pods bound" if complete or not reason else reason.message),
        workload,
    )
    kvadmission.tell_kv(cycle, workload, kv)
    status: dict[str, Any] = {
        "observedGeneration": workload.generation,
        "roles": [common.to_wire(r) for r in roles],
        "roleSummary": inferenceservice.summarize_roles(roles),
        "placement": _placement_summary(placed, cycle.supernode_of),
        "conditions": [
            common.to_wire(c)
            for c in common.set_condition(conditions_of(cycle, workload), condition)
        ],
    }
    if expert_map:
        status["expertMap"] = expert_map
    if kv is not None:
        status["kvCache"] = kvadmission.kv_status(kv, cycle.world)
    return status


async def write_expert_map(
    cycle: cyclestate.CycleState,
    workload: Workload,
    plans: list[gangs.Gang],
    by_name: Mapping[str, convert.PodFacts],
    just_bound: Mapping[model.PodKey, model.Assignment],
) -> str | None:
    assert isinstance(workload.model, inferenceservice.InferenceService)
    ep_roles = {r.name: r for r in workload.model.spec.roles if r.expert_parallel}
    if not ep_roles:
        return None
    name = labels.expert_map_config_map(workload.name)
    layouts = expert_layouts(workload)
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
        layout = layouts.get(role.name)
        mapping = gangs.expert_map(role, cards, [p.name for p in gang.pods], layout)
        key = labels.expert_map_key(role.name, gang.pods[0].replica)
        data[key] = json.dumps(mapping, separators=(",", ":"))
    content = json.dumps(data, sort_keys=True)
    if data and cycle.memory.expert_maps.get(workload.uid) != content:
        await cycle.act.apply_configmap(workload.namespace, name, data, workload.ref)
        cycle.memory.expert_maps[workload.uid] = content
    return name if data else None


def expert_layouts(workload: Workload) -> dict[str, list[int]]:
    """Role → the layout of the expert map that ``status.experts`` says is in force (written
    by :mod:`matrixpool.controllers.experts`); a role without one keeps the first layout."""
    return {role: e.layout for role, e in workload.experts().items() if e.layout}


def first_reason(cycle: cyclestate.CycleState, plans: Iterable[gangs.Gang]) -> model.Reason | None:
    return next(
        (
            cycle.memory.reasons[g.request.gang]
            for g in plans
            if g.request.gang in cycle.memory.reasons
        ),
        None,
    )


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
    resizes: Sequence[Mapping[str, Any]] = (),
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
    scheduled = new_condition(
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
            conditions, new_condition("Failed", True, code, message[:32768], workload)
        )
    if complete and preempted is not None:
        conditions = common.set_condition(
            conditions,
            new_condition("Preempted", False, "Resumed", "the gang is bound again", workload),
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
    if resizes:
        history = regroup.close_superseded(resizes, workload.status, preemptions)
        status["resizes"] = (
            regroup.finished(history, facts, _told_steps(facts)) if complete else history
        )
    return status


def _told_steps(facts: Sequence[convert.PodFacts]) -> set[int]:
    """The steps the pods' restore annotations name."""
    steps = set()
    for pod in facts:
        try:
            told = restore_codec.parse_restore(pod.restore)
        except ValueError:
            continue
        if told is not None and told.step is not None:
            steps.add(told.step)
    return steps


def resumed(
    preemptions: Sequence[Mapping[str, Any]], facts: Sequence[convert.PodFacts]
) -> list[dict[str, Any]]:
    """status.preemptions once the gang is bound again: the newest eviction (not a shrink) is
    closed with when, and the step the new pods were told to restore."""
    history = [dict(p) for p in preemptions]
    last = history[-1]
    if last.get("resumedAt") or last.get("replicasKept") is not None:
        return history
    steps = _told_steps(facts)
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
    return common.replacing(  # superNode null when no pod is bound any more
        common.PlacementStatus(
            super_node=supernodes[0] if supernodes else None,
            super_nodes=supernodes,
            nodes=nodes,
            cards=sum(len(c) for _, c in placed),
        )
    )


def conditions_of(cycle: cyclestate.CycleState, workload: Workload) -> list[common.Condition]:
    """The workload's conditions as this cycle last wrote them, else as the index shows."""
    remembered = cycle.memory.conditions.get(workload.uid)
    return _conditions({"conditions": remembered} if remembered else workload.status)


def _conditions(status: Mapping[str, Any]) -> list[common.Condition]:
    return [common.Condition.model_validate(c) for c in status.get("conditions") or []]


def new_condition(
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
