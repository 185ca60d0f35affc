"""Preemption in the scheduling cycle: the victims' requests with the work each would lose
(:func:`victims`, from phase 5), a preemptor's victims asked to checkpoint before they give up
their pods (:func:`preempt`, phase 5), and the victims that answered or ran out of grace giving
them up (:func:`finish_preemptions`, phase 4b): an elastic gang shrinks, another is evicted whole
and marked Preempted, and a TrainingJob's ``status.preemptions`` records it. Called by
:mod:`.cycle` and :mod:`.placement`.

Lost work (:func:`lost_work_per_card`; the engine prefers the plan that loses the least,
:mod:`matrixpool.placement.preemption`): a TrainingJob loses, per card, the seconds since the
latest of its newest committed checkpoint (``status.checkpoints.committedAt``), its gang's
binding (the ``Scheduled`` condition turning True) and its last recovery (``recoveredAt``):
work before its current run started is not at stake. An InferenceService loses no progress, only
the time a replica takes to come back (loading weights, warming up): a fixed
:data:`INFERENCE_LOST_SECONDS` per card."""

from __future__ import annotations

import dataclasses
import datetime
import uuid
from collections.abc import Mapping
from typing import Any

import structlog

from matrixpool import clock, metrics
from matrixpool.api import common, inferenceservice, labels, trainingjob
from matrixpool.controllers.scheduling import cyclestate, status
from matrixpool.placement import model
from matrixpool.state import decisions
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool.timeshare import transition

log = structlog.get_logger(__name__)

INFERENCE_LOST_SECONDS = 60.0  # what an inference replica loses per card when it stops
DEFAULT_GRACE_SECONDS = 60.0  # a preempted job's checkpoint grace without a SuperNode's own
CHECK_SECONDS = 0.5  # a preempted job's daemons are asked at most this often


def victims(cycle: cyclestate.CycleState) -> dict[model.GangKey, model.GangRequest]:
    """Every gang's request, with the seconds of work each of its cards would lose now: none
    for a gang already preempted (asked to checkpoint, or its pods going), so that a plan
    made again while it gives way takes it again rather than a new victim."""
    now = clock.SYSTEM.now()
    lost = {w.uid: lost_work_per_card(w, now) for w in cycle.world.workloads}
    going = _going(cycle)
    given = cycle.world.decisions.preempting
    return {
        key: dataclasses.replace(
            gang.request,
            lost_work_per_card_s=0.0
            if workload.uid in given or any(p.key in going for p in gang.pods)
            else lost[workload.uid],
        )
        for key, (workload, gang) in cycle.by_gang.items()
    }


def _going(cycle: cyclestate.CycleState) -> set[str]:
    """Pods deleting, or deleted earlier in this cycle (a regroup replaces a whole gang)."""
    return {
        p.key
        for facts in cycle.world.pods.values()
        for p in facts
        if p.deleting or p.uid in cycle.assumed.deleted
    }


def lost_work_per_card(workload: Workload, now: datetime.datetime) -> float:
    """Seconds of work each card of ``workload`` loses if it stops at ``now`` (module doc)."""
    if workload.kind != trainingjob.KIND:
        return INFERENCE_LOST_SECONDS
    status = workload.status
    checkpoints = status.get("checkpoints") or {}
    recoveries = status.get("recoveries") or [{}]
    conditions = status.get("conditions") or []
    scheduled: Mapping[str, Any] = next((c for c in conditions if c.get("type") == "Scheduled"), {})
    since = [
        _time(checkpoints.get("committedAt") if isinstance(checkpoints, Mapping) else None),
        _time(scheduled.get("lastTransitionTime") if scheduled.get("status") == "True" else None),
        _time(recoveries[-1].get("recoveredAt") if isinstance(recoveries[-1], Mapping) else None),
    ]
    start = max((t for t in since if t is not None), default=None) or _time(workload.created)
    return max(0.0, (now - start).total_seconds()) if start is not None else 0.0


def _time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 time of the API, or None when absent or unreadable."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


async def preempt(
    cycle: cyclestate.CycleState, item: cyclestate.Pending, plan: model.Preemption
) -> bool:
    """Ask every victim to checkpoint; training that saves checkpoints gives up its pods
    when it answers or its grace is over (phase 4b), the rest at once. False when every
    victim's pods already go (nothing to do but wait for their cards)."""
    by, priority = item.gang.request.gang, item.gang.request.priority
    request_id = uuid.uuid4().hex[:12]
    victims: list[tuple[Workload, list[tuple[str, str]], int | None]] = []
    for key, keep in plan.shrink.items():
        workload, gang = cycle.by_gang[key]
        per = max(1, len(gang.pods) // max(1, cycle.effective(workload)))
        victims.append((workload, [(p.namespace, p.name) for p in gang.pods[keep:]], keep // per))
    for key in plan.evict:
        workload, gang = cycle.by_gang[key]
        victims.append((workload, [(p.namespace, p.name) for p in gang.pods], None))
    going = _going(cycle)
    victims = [  # a gang whose pods already go frees their cards without being asked again
        (w, live, kept)
        for w, pods_of, kept in victims
        if (live := [p for p in pods_of if f"{p[0]}/{p[1]}" not in going])
    ]
    if not victims:
        return False
    doomed = [pod for _, pods_of, _ in victims for pod in pods_of]
    await cycle.act.annotate(doomed, {labels.CHECKPOINT_REQUEST: request_id})
    for workload, pods_of, kept in victims:
        grace = checkpoint_grace(cycle, workload)
        if grace is None:
            record = trainingjob.Preemption(
                by=by,
                priority=priority,
                request_id=request_id,
                evicted_at=clock.SYSTEM.now(),
                replicas_kept=kept,
                world_size=_world(cycle, workload),
                checkpoint=trainingjob.PreemptionCheckpoint.NOT_ASKED,
                step=_newest(workload),
            )
            await give_up(cycle, workload, pods_of, record, "")
            continue
        cycle.world.decisions.preempt(
            workload.uid,
            decisions.Preempting(
                request_id,
                by,
                priority,
                clock.SYSTEM.now(),
                grace,
                _newest(workload),
                tuple(pods_of),
                kept,
            ),
        )
        cycle.event(
            workload,
            "Normal",
            "CheckpointRequested",
            f"preempted by {by} (priority {priority}): checkpoint asked before giving up "
            f"{len(pods_of)} pods (request {request_id}, grace {grace:g} s)",
        )
    metrics.PREEMPTIONS.labels("shrink").inc(len(plan.shrink))
    metrics.PREEMPTIONS.labels("evict").inc(len(plan.evict))
    cycle.event(
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


def checkpoint_grace(cycle: cyclestate.CycleState, workload: Workload) -> float | None:
    """Seconds a victim gets to checkpoint: None (at once) for inference and for training
    that saves no checkpoint or has no pod running; else its own
    ``spec.checkpoint.graceSeconds``, its SuperNode's ``timeSharing.checkpointGraceSeconds``,
    or :data:`DEFAULT_GRACE_SECONDS`."""
    if not isinstance(workload.model, trainingjob.TrainingJob):
        return None
    tiers = workload.model.spec.checkpoint
    if not (tiers.memory or tiers.local or tiers.persistent):
        return None
    if not any(p.phase == "Running" for p in cycle.world.pods.get(workload.key, [])):
        return None
    if tiers.grace_seconds is not None:
        return float(tiers.grace_seconds)
    sn = cycle.world.supernodes.get(workload.model.spec.super_node or "")
    sharing = sn.spec.time_sharing if sn is not None else None
    return float(sharing.checkpoint_grace_seconds) if sharing else DEFAULT_GRACE_SECONDS


async def finish_preemptions(cycle: cyclestate.CycleState) -> None:
    """Phase 4b: victims asked to checkpoint give up their pods once they answered or their
    grace is over; the daemons are asked in the background (controllers.background)."""
    decisions = cycle.world.decisions
    by_uid = {w.uid: w for w in cycle.world.workloads}
    for uid, asked in list(decisions.preempting.items()):
        workload = by_uid.get(uid)
        if workload is None:
            decisions.preempted(uid)
            continue
        at, step = cycle.memory.answers.get(uid, (float("-inf"), None))
        now = clock.SYSTEM.monotonic()
        if now - at >= CHECK_SECONDS:
            cycle.memory.tasks.start(uid, check(cycle, workload, now))
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
        decisions.preempted(uid)
        cycle.memory.answers.pop(uid, None)
        record = trainingjob.Preemption(
            by=asked.by,
            priority=asked.priority,
            request_id=asked.request,
            requested_at=asked.requested_at,
            evicted_at=real,
            replicas_kept=asked.keep,
            world_size=_world(cycle, workload),
            checkpoint=trainingjob.PreemptionCheckpoint.ANSWERED
            if answered
            else trainingjob.PreemptionCheckpoint.GRACE_EXPIRED,
            step=step,
            checkpoint_seconds=round(max(waited, 0.0), 3),
        )
        await give_up(cycle, workload, list(asked.doomed), record, how)


def _world(cycle: cyclestate.CycleState, workload: Workload) -> int | None:
    """The world a TrainingJob's live pods were made for (None for a service, or not known)."""
    live = [p for p in cycle.world.pods.get(workload.key, []) if not p.deleting]
    return max((p.world for p in live), default=0) or None


async def check(cycle: cyclestate.CycleState, workload: Workload, at: float) -> None:
    """The newest step every rank of a preempted job committed, on the daemons of its
    nodes (and its tier 3): whether it answered."""
    assert isinstance(workload.model, trainingjob.TrainingJob)
    _, known = cycle.memory.answers.get(workload.uid, (at, None))
    cycle.memory.answers[workload.uid] = (at, known)  # asked: not again too soon
    nodes = {str(n.name): n.endpoint for n in cycle.world.nodes if n.endpoint}
    endpoints = {
        p.node: nodes[p.node]
        for p in cycle.world.pods.get(workload.key, [])
        if p.node and p.node in nodes
    }
    persistent = workload.model.spec.checkpoint.persistent
    found = await cycle.act.inventory(
        workload.uid, endpoints, persistent.uri if persistent else None
    )
    size = read_model.replicas_now(cycle.world, workload)
    cycle.memory.answers[workload.uid] = (at, found.newest_complete(size))


async def give_up(
    cycle: cyclestate.CycleState,
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
        history = [*cycle.preemptions(workload), common.to_wire(record)]
        history = history[-trainingjob.KEPT_PREEMPTIONS :]
        cycle.memory.preemptions[workload.uid] = history
        extra["preemptions"] = history
    if keep is not None:
        await cycle.set_replicas(workload, keep, extra)
        cycle.event(workload, "Warning", "Shrunk", f"shrunk to {keep} replicas {why}")
    else:
        cycle.memory.statuses.pop(workload.uid, None)
        await mark_preempted(cycle, workload, f"evicted {why}", extra)
    # The pods asked to checkpoint, as they are now: each deleted by its UID, so that a pod
    # made again under a victim's name since it was asked is only deleted as that pod.
    live = {p.key: p for facts in cycle.world.pods.values() for p in facts}
    going = [pod for namespace, name in doomed if (pod := live.get(f"{namespace}/{name}"))]
    await cycle.act.delete_pods([pod.ref for pod in going])
    for pod in going:
        cycle.assumed.deleting(pod)
    cycle.preempted = True


async def mark_preempted(
    cycle: cyclestate.CycleState,
    workload: Workload,
    message: str,
    extra: Mapping[str, Any] | None = None,
) -> None:
    plural = trainingjob.PLURAL if workload.kind == trainingjob.KIND else inferenceservice.PLURAL
    condition = status.new_condition("Preempted", True, "Preempted", message[:32768], workload)
    conditions = common.set_condition(status.conditions_of(cycle, workload), condition)
    wire = [common.to_wire(c) for c in conditions]
    cycle.memory.conditions[workload.uid] = wire
    await cycle.act.patch_status(
        plural, workload.namespace, workload.name, {"conditions": wire, **(extra or {})}
    )
    cycle.event(workload, "Warning", "Preempted", condition.message)


def _newest(workload: Workload) -> int | None:
    """The newest step status.checkpoints shows on any tier."""
    steps = [s for s in (workload.status.get("checkpoints") or {}).values() if isinstance(s, int)]
    return max(steps, default=None)
