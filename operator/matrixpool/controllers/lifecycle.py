"""The end of a TrainingJob's life: it ``Succeeded`` once every rank's pod exited 0, and its
pods are deleted ``spec.ttlSecondsAfterFinished`` later. DESIGN.md, "Real pods contract".

Called by the main loop (:func:`observe`, before recovery, so no controller of that pass acts on
a job that just finished) and by the scheduling cycle (:func:`expired` in its pods phase,
:func:`finished_status` in its status phase: the cycle stays the one writer of phase and
conditions).

Rules:

1. A job succeeds when, for every rank it runs with, a pod of that rank has phase Succeeded
   (restartPolicy Never and exit 0, as a kubelet reports it) and none is being deleted. A pod
   that Succeeded while others still run is no fault.
2. It never goes back: ``decisions.Decisions.succeeded`` remembers it until the status shows phase
   Succeeded, which the read model trusts from then on (an operator restarted later too).
3. A finished job's pods are kept for their logs; they hold no card (the World shows them
   ``released``), are never recreated, never recovered, and time-sharing does not count them.
4. ``spec.ttlSecondsAfterFinished`` after ``status.completionTime``, its pods are deleted, and
   its tiers 1 and 2 on the daemons go with the next sweeps (``controllers.cleanup``: a step a
   finished job keeps there is protected from eviction, and would fill tier 1); the job, and
   its tier 3, stay (see the field's description for why).

Errors: none of its own; the executor's are the caller's.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import structlog

from matrixpool import clock
from matrixpool.api import common, trainingjob
from matrixpool.k8s import convert, executor
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload

log = structlog.get_logger(__name__)

CONDITION = "Complete"  # the condition type a Kubernetes Job sets when it succeeds
REASON = "AllRanksSucceeded"


def all_ranks_succeeded(world: read_model.World, workload: Workload) -> bool:
    """Rule 1: every rank has a pod that Succeeded, and no pod of the job is going."""
    facts = world.pods.get(workload.key, [])
    if any(p.deleting for p in facts):
        return False
    done = {p.rank for p in facts if p.phase == "Succeeded"}
    size = read_model.replicas_now(world, workload)
    return size > 0 and done >= set(range(size))


def observe(world: read_model.World, act: executor.Executor) -> None:
    """Rule 2: remember the jobs whose every rank just succeeded, with an Event."""
    for workload in world.workloads:
        if not isinstance(workload.model, trainingjob.TrainingJob):
            continue
        if read_model.succeeded(world, workload):
            continue
        if read_model.failed_reason(world, workload) is not None:
            continue
        if read_model.recovery_of(world, workload):
            continue  # the recovery restarts ranks: they have not all finished this run
        if not all_ranks_succeeded(world, workload):
            continue
        world.decisions.succeed(workload.uid, clock.SYSTEM.now())
        size = read_model.replicas_now(world, workload)
        act.event(workload.ref, "Normal", "Succeeded", f"every rank ({size}) exited 0")
        log.info("job succeeded", job=workload.key, ranks=size)


def past_ttl(world: read_model.World, workload: Workload, now: datetime.datetime) -> bool:
    """Rule 4: whether ``workload`` finished ``spec.ttlSecondsAfterFinished`` ago or more."""
    done = read_model.completed(world, workload)
    if done is None or not isinstance(workload.model, trainingjob.TrainingJob):
        return False
    ttl = workload.model.spec.ttl_seconds_after_finished
    return ttl is not None and now >= done + datetime.timedelta(seconds=ttl)


def expired(
    world: read_model.World, workload: Workload, now: datetime.datetime
) -> list[convert.PodFacts]:
    """Rule 4: the pods of a finished job to delete now (its ttl passed), else []."""
    if not past_ttl(world, workload, now):
        return []
    return [p for p in world.pods.get(workload.key, []) if not p.deleting]


def finished_status(
    workload: Workload,
    world: read_model.World,
    conditions: Sequence[common.Condition],
) -> dict[str, Any]:
    """The status of a job that succeeded: phase Succeeded, its completionTime, condition
    Complete, no card held (its pods are kept, ``replicas.bound`` counts none)."""
    done = read_model.completed(world, workload)
    assert done is not None
    size = read_model.replicas_now(world, workload)
    complete = common.Condition(
        type=CONDITION,
        status=common.ConditionStatus.TRUE,
        reason=REASON,
        message=f"every rank ({size}) exited 0; the pods are kept for their logs",
        last_transition_time=done,
        observed_generation=workload.generation,
    )
    return {
        "observedGeneration": workload.generation,
        "phase": trainingjob.Phase.SUCCEEDED.value,
        "completionTime": done.isoformat().replace("+00:00", "Z"),
        "replicas": {"desired": size, "bound": 0, "running": 0},
        "placement": common.replacing(common.PlacementStatus()),
        "conditions": [common.to_wire(c) for c in common.set_condition(conditions, complete)],
    }
