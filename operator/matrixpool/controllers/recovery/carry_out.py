"""Steps 4 and 5 of a recovery, **carry out** and **record** (:func:`carry_out`, called every
pass until done by :func:`.controller.step`, and first by :func:`.decide.start`):

4. Idempotent: InPlace and SpareSwap delete the hit ranks' pods; the scheduler recreates them
   already reserved on their target node and cards (:func:`..scheduling.gangpods.pin`)
   and binds them; the other ranks get the new ``matrixpool.dev/restore`` annotation and reload
   that step where they run. Reschedule deletes the whole gang; the scheduler places it again
   wherever it fits, each new pod told what to restore.
5. Once every rank runs again (:func:`finish`), ``status.recoveries[]`` gets the entry (level,
   cause, restoredStep, lostSteps, detectedAt, recoveredAt) and keeps the newest
   :data:`~matrixpool.api.trainingjob.KEPT_RECOVERIES`; ``status.recoveryCount`` counts them
   all (:func:`recorded`, :func:`recovery_count`). An Event and the metrics follow.

Also the end of a job no level can save (:func:`fail`), decided in :mod:`.decide`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from matrixpool import clock, metrics
from matrixpool.api import labels, trainingjob
from matrixpool.controllers.recovery import memory
from matrixpool.k8s import convert, executor
from matrixpool.placement import inventory
from matrixpool.state import decisions
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload
from matrixpool_recovery import policy
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)

FRESH = "no checkpoint yet: restarted from step 0"  # Events of a recovery from scratch


async def carry_out(
    workload: Workload,
    recovery: decisions.RecoveryPlan,
    facts: Sequence[convert.PodFacts],
    nodes: Mapping[str, inventory.NodeInfo],
    lost: frozenset[str],
    world: read_model.World,
    state: memory.State,
    act: executor.Executor,
) -> None:
    """Move the world one step toward the plan; finish when every rank runs again."""
    recovery_id = recovery.id
    targets = recovery.targets
    reschedule = recovery.reschedule
    doomed_now: list[tuple[str, str, str]] = []  # dead nodes and failed pods: no grace
    doomed: list[tuple[str, str, str]] = []
    reload: dict[tuple[str, str], str] = {}
    # A node is dead to us when its daemon is unreachable, its Node is down, or its kubelet's
    # Lease went stale (before the controller-manager marks it NotReady): its kubelet would
    # never finish a graceful delete, and the new pods wait until the old ones are gone.
    dead_nodes = set(lost) | set(world.stale)
    for pod in facts:
        on_dead_node = pod.node in dead_nodes or _down(nodes, pod.node)
        if pod.deleting:
            if on_dead_node:  # deleted with grace before it died: now without
                doomed_now.append(pod.ref)
            continue
        mine = _recovery_id(pod.restore) == recovery_id
        moved = str(pod.rank) in targets
        if (reschedule or moved) and not mine:
            dead = pod.phase in convert.TERMINAL_PHASES or on_dead_node
            (doomed_now if dead else doomed).append(pod.ref)
        elif not mine and (value := recovery.restore_for(pod.rank)) is not None:
            reload[(pod.namespace, pod.name)] = value
    if doomed_now:
        await act.delete_pods(doomed_now, grace_seconds=0)
    if doomed:
        await act.delete_pods(doomed)
    by_value: dict[str, list[tuple[str, str]]] = {}
    for key, value in reload.items():
        by_value.setdefault(value, []).append(key)
    await asyncio.gather(  # one batch per distinct value (InPlace: one for every rank)
        *(act.annotate(keys, {labels.RESTORE: value}) for value, keys in by_value.items())
    )
    if doomed_now or doomed or reload:
        return
    assert isinstance(workload.model, trainingjob.TrainingJob)
    ranks = {p.rank: p for p in facts if not p.deleting}
    # A gang with no pod has not recovered, whatever the allowance says now: its new pods,
    # pinned and told what to restore while the recovery is under way, are still to come.
    wanted = read_model.replicas_now(world, workload)
    done = (
        wanted > 0
        and len(ranks) >= wanted
        and all(
            p.phase == "Running"
            and _recovery_id(p.restore) == recovery_id
            and (str(p.rank) not in targets or p.node == targets[str(p.rank)])
            for p in ranks.values()
        )
    )
    if done:
        await finish(workload, recovery, world, state, act)


async def finish(
    workload: Workload,
    recovery: decisions.RecoveryPlan,
    world: read_model.World,
    state: memory.State,
    act: executor.Executor,
) -> None:
    recovered = clock.SYSTEM.now()
    await act.pin(workload.uid, recovery.pinned, None)
    record = recovery.record(recovered)
    seen = recovery.id in state.recorded
    await act.patch_status(
        trainingjob.PLURAL,
        workload.namespace,
        workload.name,
        recorded(workload.status, record, seen=seen) | {"recovering": None},
    )
    state.recorded.add(recovery.id)
    world.decisions.recovered(workload.uid)
    seconds = (recovered - recovery.detected_at).total_seconds()
    level = recovery.level
    metrics.RECOVERIES.labels(level).inc()
    metrics.RECOVERY_SECONDS.labels(level).observe(seconds)
    done = recovery.status
    what = (
        FRESH
        if done.from_scratch
        else f"step {done.restored_step} restored, lost steps {describe_lost(done.lost_steps)}"
    )
    act.event(
        workload.ref,
        "Normal",
        "Recovered",
        f"{level} recovery {recovery.id} done in {seconds:.1f} s: {what}",
    )
    log.info("recovered", job=workload.key, level=level, seconds=round(seconds, 2))


def fail(
    workload: Workload, failed: policy.Failed, world: read_model.World, act: executor.Executor
) -> None:
    """No recovery: the job fails with the reason, and gives its cards back. The scheduler
    writes it (phase and condition Failed: it owns both) in this pass's status."""
    world.decisions.fail(workload.uid, failed.code, failed.reason)
    metrics.RECOVERY_FAILURES.labels(failed.code).inc()
    act.event(workload.ref, "Warning", failed.code, failed.reason)
    log.warning("job failed", job=workload.key, reason=failed.code, message=failed.reason)


def recorded(
    status: Mapping[str, Any], record: Mapping[str, Any], *, seen: bool = False
) -> dict[str, Any]:
    """status.recoveries with ``record`` appended (unless ``seen`` or listed already), trimmed
    to the newest KEPT_RECOVERIES, and status.recoveryCount counting it."""
    history = [dict(r) for r in status.get("recoveries") or []]
    count = recovery_count(status)
    if not seen and all(r.get("id") != record["id"] for r in history):
        history.append(dict(record))
        count += 1
    return {"recoveries": history[-trainingjob.KEPT_RECOVERIES :], "recoveryCount": count}


def recovery_count(status: Mapping[str, Any]) -> int:
    """Recoveries so far: status.recoveryCount (or, for an object written before it existed,
    the length of status.recoveries)."""
    listed = len(status.get("recoveries") or [])
    return max(int(status.get("recoveryCount") or 0), listed)


def _recovery_id(value: str) -> str:
    return restore_codec.restore_id(value)


def _down(nodes: Mapping[str, inventory.NodeInfo], node: str | None) -> bool:
    return node is not None and (node not in nodes or nodes[node].down)


def describe_lost(steps: Any) -> str:
    """``lostSteps`` as an Event says it (None: unknown)."""
    return "unknown" if steps is None else str(steps)
