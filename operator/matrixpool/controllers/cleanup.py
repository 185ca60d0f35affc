"""The checkpoints of deleted TrainingJobs go with them.

Daemons know a job by its UID (``matrixpool.k8s.daemonclient``). Two paths delete what they hold:

1. **On delete** (``deleted_job``): when the watch sees a TrainingJob go, every daemon is asked
   to drop the job's tiers 1 and 2, and tier 3 too when
   ``spec.checkpoint.persistent.reclaimPolicy`` is ``Delete`` (default ``Retain``: the files
   stay under the URI). No finalizer: deleting a job never waits for the operator or a daemon;
   a deletion the operator did not see (it was down) leaves tier 3 in place.
2. **The sweep** (``sweep``, started by the main loop every :data:`SWEEP_SECONDS`, in a task of
   its own so that a slow daemon never holds the scheduling cycle): a job UID that daemons
   hold and no TrainingJob has, in two sweeps in a row, is dropped. It catches what the first
   path missed (the operator down at the time, a daemon unreachable then). A job that
   Succeeded ``spec.ttlSecondsAfterFinished`` ago counts as gone for it too: its tiers 1 and 2
   are released with its pods (tier 3 stays), so that finished jobs' protected steps never
   fill tier 1. Without a ttl they stay until the job is deleted.

Called by kopf (``deleted_job``) and by :mod:`matrixpool.controllers.loop` (``sweep``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf
import structlog

from matrixpool import api, clock, metrics
from matrixpool.api import trainingjob
from matrixpool.k8s import daemonleases, executor
from matrixpool.placement import inventory
from matrixpool.state.workloads import Workload

SWEEP_SECONDS = 30.0  # between two sweeps of the daemons' inventories
log = structlog.get_logger(__name__)


@dataclass
class Sweeper:
    """The sweep's memory: orphans seen once, the running task, when it last ran."""

    orphans: set[str] = field(default_factory=set)  # job UIDs no TrainingJob had last time
    task: asyncio.Task[None] | None = None
    last: float = float("-inf")  # monotonic time of the last start

    def due(self, now: float) -> bool:
        return (self.task is None or self.task.done()) and now - self.last >= SWEEP_SECONDS


def orphans(held: set[str], live: set[str], seen_before: set[str]) -> tuple[set[str], set[str]]:
    """(to delete now, to remember): a job is deleted the second sweep in a row it is held
    and no TrainingJob has its UID (a job created between the listing and the inventory is
    never deleted on one look)."""
    unknown = held - live
    return unknown & seen_before, unknown - seen_before


async def sweep_once(
    sweeper: Sweeper, endpoints: list[str], live: set[str], act: executor.Executor
) -> None:
    held = await act.jobs_held(endpoints)
    delete, remember = orphans(set(held), live, sweeper.orphans)
    sweeper.orphans = remember
    for job in sorted(delete):
        done = await act.delete_checkpoints(job, held[job])
        metrics.CHECKPOINTS_DELETED.labels("orphan").inc(len(done))
        log.info("deleted checkpoints of a job that no longer exists", job=job, daemons=done)


def sweep(
    sweeper: Sweeper,
    nodes: list[inventory.NodeInfo],
    workloads: list[Workload],
    act: executor.Executor,
    finished: Callable[[Workload], bool] = lambda _: False,
) -> None:
    """Start a sweep when one is due (never two at once). ``finished``: whether a job is past
    its ttl after it Succeeded (its tiers 1 and 2 go as an orphan's)."""
    now = clock.SYSTEM.monotonic()
    if not sweeper.due(now):
        return
    sweeper.last = now
    endpoints = sorted({n.endpoint for n in nodes if n.endpoint})
    live = {w.uid for w in workloads if w.kind == trainingjob.KIND and not finished(w)}
    sweeper.task = asyncio.create_task(sweep_once(sweeper, endpoints, live, act), name="ckpt-sweep")


def _deleted(type: str, **_: Any) -> bool:
    """Only a deletion calls the handler (kopf logs every call it makes; a status patch every
    few seconds is no reason for a line)."""
    return type == "DELETED"


@kopf.on.event(api.GROUP, api.VERSION, trainingjob.PLURAL, when=_deleted)  # type: ignore[arg-type]
async def deleted_job(
    type: str,
    body: kopf.Body,
    daemon_leases: kopf.Index[str, daemonleases.Announced],
    node_facts: kopf.Index[str, inventory.NodeInfo],
    **_: Any,
) -> None:
    """The watch saw a TrainingJob go (no finalizer holds it: deleting a job never waits)."""
    if type != "DELETED":
        return
    meta = body.get("metadata") or {}
    uid, name, namespace = meta.get("uid", ""), meta.get("name"), meta.get("namespace")
    if not uid:
        return
    addresses = {node: info.address for node, store in node_facts.items() for info in store}
    endpoints = sorted(
        {
            a.endpoint
            for node, store in daemon_leases.items()
            for a in store
            if daemonleases.on_node(a.endpoint, addresses.get(node, ""))
        }
    )
    act = executor.Live()  # a kopf handler: not run by the loop, which gives the others theirs
    done = await act.delete_checkpoints(uid, endpoints)
    metrics.CHECKPOINTS_DELETED.labels("deleted").inc(len(done))
    persistent = ((body.get("spec") or {}).get("checkpoint") or {}).get("persistent") or {}
    reclaimed = False
    if persistent.get("reclaimPolicy") == trainingjob.ReclaimPolicy.DELETE.value:
        reclaimed = await act.delete_persistent(uid, persistent["uri"])
    log.info(
        "deleted the checkpoints of a deleted job",
        job=f"{namespace}/{name}",
        uid=uid,
        daemons=len(done),
        asked=len(endpoints),
        persistent="deleted" if reclaimed else "kept",
    )
