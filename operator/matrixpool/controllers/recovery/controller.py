"""The recovery controller's entry: one pass over the TrainingJobs (:func:`run`) and one job's
dispatch (:func:`step`). DESIGN.md, "Recovery contract"; the decision itself is the pure
:func:`matrixpool_recovery.policy.decide`.

The main loop (:mod:`matrixpool.controllers.loop`) calls :func:`run` before every scheduling cycle,
so a fault is acted on within one loop period of its showing in the API (about 0.25 s) — the
Node watch sees Ready go False at once, no controller-manager grace is waited for — or within
:data:`~.memory.UNREACHABLE_AFTER` of a node's checkpoint daemon going silent (its heartbeat,
probed every :data:`~.heartbeat.PROBE_SECONDS`, :mod:`.heartbeat`).

Per TrainingJob whose gang is bound, each loop:
1. **Detect** (:mod:`.detect`, pure).
2. **Decide** and 3. **write the plan first** (:mod:`.decide`).
4. **Carry out** (idempotent, every loop until done) and 5. **record** (:mod:`.carry_out`).
A job with no fault has its ``status.checkpoints`` refreshed instead (:mod:`.checkpoints`).
``maxRecoveries`` reached (by ``recoveryCount``), or no level possible: the job goes Failed
with the reason. A step that raises is tried again after an exponential backoff per job
(:data:`~.memory.BACKOFF_FIRST` doubling up to :data:`~.memory.BACKOFF_MAX`, a
``RecoveryBackoff`` Event each time), reset by the next step that succeeds.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from matrixpool import clock
from matrixpool.api import trainingjob
from matrixpool.controllers.recovery import (
    carry_out,
    checkpoints,
    decide,
    detect,
    heartbeat,
    memory,
)
from matrixpool.k8s import executor
from matrixpool.placement import inventory
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload

log = structlog.get_logger(__name__)

WAIT_SECONDS = 3.0  # the longest a pass waits for its probe or a poll (a daemon's timeout)


async def run(world: read_model.World, state: memory.State, act: executor.Executor) -> None:
    """One pass: probe the daemons, then detect, decide, carry out and record per job.

    The probe and the polls run as tasks (never two at once) but the pass waits for them, at
    most :data:`WAIT_SECONDS`: run fully in the background they made the recovery benchmark
    fail to find a common step in 4 of 7 runs (cause not yet found), so a slow daemon still
    costs the loop up to that long per probe here."""
    heartbeat.probe(world, state, act)
    await state.tasks.settle("probe", WAIT_SECONDS)
    nodes: dict[str, inventory.NodeInfo] = {n.name: n for n in world.nodes}
    lost = state.unreachable(clock.SYSTEM.monotonic()) - world.restarting  # a rollout: waits
    for workload in world.workloads:
        if not isinstance(workload.model, trainingjob.TrainingJob):
            continue
        if read_model.failed_reason(world, workload) is not None:
            continue
        if read_model.succeeded(world, workload):
            continue  # finished: its pods are kept for their logs, never recovered
        if state.backing_off(workload.uid, clock.SYSTEM.monotonic()):
            continue
        try:
            done = await step(workload, world, nodes, lost, state, act)
        except Exception as error:  # one job's trouble must not stop the others' recoveries
            back_off(workload, error, state, act)
        else:
            if done:
                state.backoff.pop(workload.uid, None)


async def step(
    workload: Workload,
    world: read_model.World,
    nodes: Mapping[str, inventory.NodeInfo],
    lost: frozenset[str],
    state: memory.State,
    act: executor.Executor,
) -> bool:
    """Detect, decide or carry out for one job; False when nothing was tried (a recovery
    deferred, or faults still settling)."""
    facts = world.pods.get(workload.key, [])
    recovery = read_model.recovery_of(world, workload)
    if recovery:
        await carry_out.carry_out(workload, recovery, facts, nodes, lost, world, state, act)
        return True
    size = read_model.replicas_now(world, workload)
    faults = detect.detect(size, facts, nodes, lost, workload, world.stale)
    if not faults:
        state.first_seen.pop(workload.uid, None)
        checkpoints.poll_checkpoints(workload, facts, nodes, world, state, act)
        await state.tasks.settle(workload.uid, WAIT_SECONDS)
        return True
    if state.deferred.get(workload.uid, 0.0) > clock.SYSTEM.monotonic():
        return False  # a recovery that was impossible, retried later
    if not detect.settled(workload, faults, state, world.noticed):
        return False
    _, detected = state.first_seen.pop(workload.uid)
    await decide.start(workload, faults, world, lost, detected, state, act)
    return True


def back_off(
    workload: Workload, error: Exception, state: memory.State, act: executor.Executor
) -> None:
    """A step of ``workload`` failed: wait before trying it again, and say so."""
    delay = state.failed(workload.uid, clock.SYSTEM.monotonic())
    log.exception("recovery step failed; backing off", job=workload.key, delay=delay)
    act.event(
        workload.ref,
        "Warning",
        "RecoveryBackoff",
        f"recovery step failed ({type(error).__name__}: {error}); trying again in {delay:.0f} s",
    )
