"""``status.checkpoints`` kept fresh: the newest step committed for every rank, per tier, and
``committedAt``, when the newest of them was first seen (preemption counts a victim's lost work
from it). The daemons of a running job's nodes are asked every :data:`POLL_SECONDS`, in a task
of its own (:func:`poll_checkpoints`, called by :func:`.controller.step` for a job with no
fault). What it last wrote is remembered in :attr:`.memory.State.checkpoints`, read by
:mod:`.decide`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matrixpool import clock
from matrixpool.api import trainingjob
from matrixpool.controllers.recovery import memory
from matrixpool.k8s import convert, executor
from matrixpool.placement import inventory
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload

POLL_SECONDS = 2.0  # status.checkpoints refresh period per running job
TIERS = ("memory", "local", "persistent")


def poll_checkpoints(
    workload: Workload,
    facts: Sequence[convert.PodFacts],
    nodes: Mapping[str, inventory.NodeInfo],
    world: read_model.World,
    state: memory.State,
    act: executor.Executor,
) -> None:
    """status.checkpoints from the daemons of the job's nodes, every POLL_SECONDS, in a task
    of its own (never two at once for a job)."""
    assert isinstance(workload.model, trainingjob.TrainingJob)
    now = clock.SYSTEM.monotonic()
    due = now - state.polled_at.get(workload.uid, float("-inf")) >= POLL_SECONDS
    if not due or state.tasks.busy(workload.uid):
        return
    state.polled_at[workload.uid] = now
    endpoints = {
        p.node: nodes[p.node].endpoint
        for p in facts
        if p.node and p.node in nodes and nodes[p.node].endpoint
    }
    if not endpoints:
        return
    spec = workload.model.spec
    persistent = spec.checkpoint.persistent.uri if spec.checkpoint.persistent else None
    size = read_model.replicas_now(world, workload)
    state.tasks.start(workload.uid, _poll(workload, endpoints, persistent, size, state, act))


async def _poll(
    workload: Workload,
    endpoints: Mapping[str, str],
    persistent: str | None,
    world_size: int,
    state: memory.State,
    act: executor.Executor,
) -> None:
    found = await act.inventory(workload.uid, dict(endpoints), persistent)
    committed = found.committed(world_size)
    known = state.checkpoints.get(workload.uid) or workload.status.get("checkpoints") or {}
    merged: dict[str, Any] = {t: _kept(committed.get(t), known.get(t)) for t in TIERS}
    merged["committedAt"] = _committed_at(merged, known)
    if merged != {t: known.get(t) for t in merged}:
        state.checkpoints[workload.uid] = merged
        await act.patch_status(
            trainingjob.PLURAL, workload.namespace, workload.name, {"checkpoints": merged}
        )


def _committed_at(merged: Mapping[str, Any], known: Mapping[str, Any]) -> str | None:
    """When the newest step was first seen: now when it is newer than every step known, else
    as known (a roll-back keeps the time: preemption also counts from the restart)."""
    if _newest(merged) > _newest(known):
        return clock.SYSTEM.now().isoformat().replace("+00:00", "Z")
    at = known.get("committedAt")
    return at if isinstance(at, str) else None


def _newest(steps: Mapping[str, Any]) -> int:
    return max((v for t in TIERS if isinstance(v := steps.get(t), int)), default=-1)


def _kept(found: int | None, known: Any) -> int | None:
    """A tier the daemons no longer report (one restarted, empty) keeps its last step; a
    recovery's roll-back shows as the step going down, which is what happened."""
    if found is None:
        return known if isinstance(known, int) else None
    return found
