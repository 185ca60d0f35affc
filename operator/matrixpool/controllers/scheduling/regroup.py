"""A TrainingJob's gang regrouped at a new size (part of phase 3, called by :mod:`.gangpods`).

Rule: a trainer learns its world once, when its process starts (``WORLD_SIZE``,
``MATRIXPOOL_WORLD_SIZE``: torchrun and ``init_process_group`` read them then), so ranks of
different worlds cannot train together: a collective waits for ranks that are gone, or never
hears of the new ones. When the size the job runs at now (:func:`read_model.replicas_now`:
``spec.replicas``, a preemption's shrink, time-sharing's allowance) differs from the world its
live pods were made for (:func:`matrixpool.state.world.disagreeing`, the detection, which
the recovery reads too), every pod of the gang is
replaced: all are deleted; once they are gone, the new size's pods are created as a new gang,
each told to restore (annotation ``matrixpool.dev/restore``) the newest step every rank of the
old world committed then, with ``"world": <old size>`` so that a rank the old world lacked
reads shard ``rank % world`` (:func:`matrixpool_recovery.restore.shard_for`) and a DCP trainer
reshards. New pods rather than an annotation to the ranks that stay: an unmodified torchrun job
cannot change its world in a running process.

``status.resizes`` (at most :data:`trainingjob.KEPT_RESIZES`, this cycle their only writer)
records each regroup, opened when it starts (so an operator restarted half-way resumes it: the
open record tells what the new pods restore) and closed by :mod:`.status` once the new gang is
bound. A job under recovery is left to the recovery; the next cycle regroups it.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from matrixpool import clock, metrics
from matrixpool.api import common, trainingjob
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.k8s import convert
from matrixpool.state.workloads import Workload
from matrixpool_recovery import restore as restore_codec

log = structlog.get_logger(__name__)


def reason(workload: Workload, to: int, time_shared: bool) -> trainingjob.ResizeReason:
    assert isinstance(workload.model, trainingjob.TrainingJob)
    if time_shared:
        return trainingjob.ResizeReason.TIME_SHARING
    if to < workload.model.spec.replicas:
        return trainingjob.ResizeReason.PREEMPTION
    return trainingjob.ResizeReason.REPLICAS


def resizes_of(cycle: cyclestate.CycleState, workload: Workload) -> list[dict[str, Any]]:
    """status.resizes as this cycle last wrote them, else as the index shows them."""
    remembered = cycle.memory.resizes.get(workload.uid)
    if remembered is not None:
        return [dict(r) for r in remembered]
    return [dict(r) for r in workload.status.get("resizes") or []]


def tag(record: Mapping[str, Any]) -> str:
    """The restore id a regroup's new pods are told (matrixpool.dev/restore)."""
    return f"resize-{record.get('id')}"


def open_resize(cycle: cyclestate.CycleState, workload: Workload) -> Mapping[str, Any] | None:
    """The regroup under way (its new gang not bound yet, the job not stopped since), or
    None."""
    history = resizes_of(cycle, workload)
    last = history[-1] if history else None
    if last is None or last.get("finishedAt"):
        return None
    return None if superseded(last, workload.status, cycle.preemptions(workload)) else last


def superseded(
    record: Mapping[str, Any],
    status: Mapping[str, Any],
    preemptions: Sequence[Mapping[str, Any]],
) -> str | None:
    """The request id of the time-sharing suspension (``status.timeSharing.suspensions``) or
    whole-gang eviction (``preemptions``) that came after regroup ``record`` started, if any:
    every pod of the job went then, and that stop's resume restores the job (the newest step
    every rank committed when it stopped), its pods told so: the regroup is over, and its own
    restore, older, must not be handed to anyone."""
    began = _instant(record.get("startedAt"))
    if began is None:
        return None
    suspensions = (status.get("timeSharing") or {}).get("suspensions") or []
    stops = [(s.get("suspendedAt"), s.get("requestId")) for s in suspensions]
    stops += [
        (p.get("evictedAt"), p.get("requestId"))
        for p in preemptions
        if p.get("replicasKept") is None
    ]
    later = [str(i or "") for at, i in stops if (t := _instant(at)) is not None and t > began]
    return later[-1] if later else None


def close_superseded(
    resizes: Sequence[Mapping[str, Any]],
    status: Mapping[str, Any],
    preemptions: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """status.resizes with an open regroup that a suspension or eviction overtook
    (:func:`superseded`) closed, naming that stop, no step restored."""
    history = [dict(r) for r in resizes]
    last = history[-1] if history else None
    if last is None or last.get("finishedAt"):
        return history
    by = superseded(last, status, preemptions)
    if by is None:
        return history
    history = close(history, int(last.get("toReplicas") or 0), None, timed=False)
    history[-1]["supersededBy"] = by
    return history


def _instant(value: Any) -> datetime.datetime | None:
    """A status timestamp as an aware instant (UTC when it names no zone), None if unreadable."""
    try:
        instant = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return instant if instant.tzinfo else instant.replace(tzinfo=datetime.UTC)


async def start(
    cycle: cyclestate.CycleState,
    workload: Workload,
    live: Sequence[convert.PodFacts],
    old: int,
    size: int,
) -> None:
    """Replace every live pod of a gang made for ``old`` ranks by ``size`` new ones: open the
    record (unless one is open whose new pods are not made yet: it goes on, to ``size``) and
    delete them all. An open record whose new pods already run (the size moved again before
    all of them were bound) is closed first: they trained on, so the next regroup restores
    what they committed, not the step the last one restored."""
    stopped = close_superseded(
        resizes_of(cycle, workload), workload.status, cycle.preemptions(workload)
    )
    if stopped != resizes_of(cycle, workload):
        cycle.memory.resizes[workload.uid] = stopped
    opened = open_resize(cycle, workload)
    made = [p for p in live if opened and restore_codec.restore_id(p.restore) == tag(opened)]
    if opened is not None and any(p.node for p in made):
        cycle.memory.resizes[workload.uid] = close(resizes_of(cycle, workload), len(made), None)
        opened = None
    if opened is None:
        why = reason(workload, size, workload.key in cycle.shares.training)
        record = common.to_wire(
            trainingjob.Resize(
                id=uuid.uuid4().hex[:12],
                from_replicas=old,
                to_replicas=size,
                reason=why,
                started_at=clock.SYSTEM.now(),
            )
        )
        history = [*resizes_of(cycle, workload), record][-trainingjob.KEPT_RESIZES :]
        cycle.memory.resizes[workload.uid] = history
        await cycle.act.patch_status(
            trainingjob.PLURAL, workload.namespace, workload.name, {"resizes": history}
        )
        verb = "shrinks" if size < old else "grows"
        cycle.event(
            workload,
            "Normal",
            "Regrouping",
            f"the gang {verb} from {old} to {size} ranks ({why.value}): every rank is replaced "
            "by one of the new world, which restores the newest step all old ranks committed",
        )
        metrics.REGROUPS.labels(why.value).inc()
        log.info("regroup", job=workload.key, old=old, new=size, reason=why.value)
    elif int(opened.get("toReplicas") or 0) != size:  # the size moved again meanwhile
        history = resizes_of(cycle, workload)
        history[-1] = {**history[-1], "toReplicas": size}
        cycle.memory.resizes[workload.uid] = history
        await cycle.act.patch_status(
            trainingjob.PLURAL, workload.namespace, workload.name, {"resizes": history}
        )
    going = [p for p in live if not p.deleting]
    await cycle.act.delete_pods([p.ref for p in going])
    for pod in going:
        cycle.assumed.deleting(pod)


def finished(
    resizes: Sequence[Mapping[str, Any]], facts: Sequence[convert.PodFacts], steps: set[int]
) -> list[dict[str, Any]]:
    """status.resizes once the new gang is bound: the open regroup closed with when,
    how long it took and the step its pods were told to restore (``steps``: those the pods'
    restore annotations name; one when they all agree)."""
    history = [dict(r) for r in resizes]
    last = history[-1] if history else None
    if last is None or last.get("finishedAt"):
        return history
    live = [p for p in facts if not p.deleting]
    if not live or not all(restore_codec.restore_id(p.restore) == tag(last) for p in live):
        return history  # not the regroup's pods (yet)
    return close(history, len(live), next(iter(steps)) if len(steps) == 1 else None)


def close(
    resizes: Sequence[Mapping[str, Any]], size: int, step: int | None, *, timed: bool = True
) -> list[dict[str, Any]]:
    """status.resizes with the open (last) record closed now at ``size`` ranks (the size may
    have moved again before the new pods came), having restored ``step`` when known; its
    seconds go to the regroup histogram when ``timed`` (not for one a stop overtook)."""
    history = [dict(r) for r in resizes]
    last = history[-1]
    now = clock.SYSTEM.now()
    last["toReplicas"] = size
    last["finishedAt"] = now.isoformat().replace("+00:00", "Z")
    started = _instant(last.get("startedAt"))
    if started is not None:  # else a record an earlier writer left without a readable start
        last["seconds"] = round(max(0.0, (now - started).total_seconds()), 3)
        if timed:
            metrics.REGROUP_SECONDS.observe(last["seconds"])
    if step is not None:
        last["restoredStep"] = step
    return history
