"""Phase 5 of the scheduling cycle: pending gangs placed whole on a snapshot, highest priority
first (:func:`place`), at most :data:`PODS_PER_CYCLE` pods a cycle. A gang that fits only by
taking cards preempts (:mod:`.preemption`) and holds the cards its victims free for
:data:`NOMINATION_SECONDS`; one that does not fit keeps its reason (a Warning Event when the
reason is new). A training gang that asks for a locality wait and would now cross more racks
than the fewest that hold it waits for them, at most that long (:func:`waits_for_fewer_racks`).
Shrunk elastic jobs grow back (:func:`grow`). Called by :mod:`.cycle`."""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from matrixpool import clock
from matrixpool.api import trainingjob
from matrixpool.controllers.scheduling import cyclestate, preemption
from matrixpool.placement import engine, gangs, model, servable
from matrixpool.state import world as read_model
from matrixpool.state.workloads import Workload

log = structlog.get_logger(__name__)

NOMINATION_SECONDS = 300.0  # a preemptor's hold on the cards its victims free lasts this long
# Pods one cycle binds at most (a larger gang still goes whole, alone): a cycle that binds
# hundreds of pods keeps recovery, time-sharing and the status report waiting for seconds
# (32 supernodes, 512 jobs submitted at once: one cycle bound 690 pods in 8.9 s). The gangs
# left over wait for the next cycle, which the loop starts at once (Memory.deferred).
PODS_PER_CYCLE = 96
# ... and fewer when the API server is slow: as many as the last binding cycle wrote in
# BIND_TARGET_SECONDS at its pace (pods per second, Memory.bind_rate), never under
# MIN_PODS_PER_CYCLE. At 64 supernodes on two cores 96 pods took 1.4 s, the slowest 2.0 s, and
# a gang bound last in a batch waited for the whole of it; at 4 supernodes 96 pods take 0.6 s.
BIND_TARGET_SECONDS = 1.0
MIN_PODS_PER_CYCLE = 16


def pod_budget(memory: cyclestate.Memory) -> int:
    """The pods this cycle may bind (:data:`PODS_PER_CYCLE`, :data:`BIND_TARGET_SECONDS`)."""
    if memory.bind_rate is None:
        return PODS_PER_CYCLE
    paced = max(MIN_PODS_PER_CYCLE, int(memory.bind_rate * BIND_TARGET_SECONDS))
    return min(PODS_PER_CYCLE, paced)


CARDS_BEING_FREED = model.Reason(
    "WaitingForEviction", "the pods of preempted gangs are terminating; their cards come next"
)

FEWER_RACKS = "WaitingForFewerRacks"  # a locality wait (spec.placement.localityWaitSeconds)

WAITING_FOR_CHECKPOINT = model.Reason(
    "WaitingForCheckpoint",
    "lower-priority training was asked to checkpoint before it gives up its cards",
)


async def place(
    cycle: cyclestate.CycleState, pending: list[cyclestate.Pending]
) -> list[cyclestate.Binding]:
    shrunk = growable(cycle)
    if not pending and not shrunk:  # a steady cycle: no snapshot to build
        cycle.memory.deferred = False
        cycle.deferred = set()
        return []
    snapshot = engine.Snapshot.build(cycle.topologies, read_model.holdings(cycle.world))
    victims = preemption.victims(cycle)  # with the work each would lose now
    bindings: list[cyclestate.Binding] = []
    never: set[model.GangKey] = set()  # gangs that can never be served: they block nobody
    pending.sort(key=lambda p: (-p.gang.request.priority, p.workload.created, p.gang.request.gang))
    cycle.memory.deferred = False
    summaries = servable.summaries(cycle.topologies)
    budget = pod_budget(cycle.memory)
    deferred: list[cyclestate.Pending] = []
    for item in pending:
        request = item.request
        if budget <= 0:  # the rest, in the same order, next cycle
            deferred.append(item)
            continue
        verdict: model.Placement | model.Unplaceable | None
        verdict = engine.check_servable(cycle.topologies, request, summaries)
        if verdict is None:
            verdict = engine.place(snapshot, request)
        key = item.gang.request.gang
        if isinstance(verdict, model.Placement) and waits_for_fewer_racks(
            cycle, item, snapshot, verdict
        ):
            continue
        if isinstance(verdict, model.Placement):
            cycle.memory.spread_since.pop(key, None)
            snapshot.commit(verdict)
            bindings.append(cyclestate.Binding(item, verdict))
            budget -= len(verdict.assignments)
            cycle.memory.reasons.pop(key, None)
            cycle.memory.nominated.pop(key, None)
            continue
        if not verdict.permanent and (cycle.world.decisions.preempting or cycle.preempted):
            if nominated(cycle, key):  # it waits for its victims' checkpoint
                planned = engine.preempt(snapshot, request, victims)
                if isinstance(planned, model.Preemption):
                    snapshot.hold_free(planned.placement)
            note_reason(cycle, item, WAITING_FOR_CHECKPOINT)  # the cards are about to move
            continue
        if not verdict.permanent:
            plan = engine.preempt(snapshot, request, victims)
            if isinstance(plan, model.Preemption):
                if await preemption.preempt(cycle, item, plan):
                    cycle.memory.nominated[key] = clock.SYSTEM.monotonic()
                    cycle.preempted = True
                    return bindings  # the world changes; place again next cycle
                snapshot.hold_free(plan.placement)  # its victims' pods are going
                first = verdict.reasons[0]  # or, waiting for fewer racks, others' pods are
                note_reason(
                    cycle, item, first if first.code == engine.LEAVING else CARDS_BEING_FREED
                )
                continue
        note_reason(cycle, item, verdict.reasons[0])
        if verdict.permanent:
            never.add(item.gang.request.gang)
    cycle.memory.deferred = bool(deferred)
    cycle.deferred = {p.gang.request.gang for p in deferred}
    placed = {b.placement.gang for b in bindings} | never
    waiting = [p.gang.request.priority for p in pending if p.gang.request.gang not in placed]
    await grow(cycle, snapshot, max(waiting, default=None), shrunk)
    return bindings


def waits_for_fewer_racks(
    cycle: cyclestate.CycleState,
    item: cyclestate.Pending,
    snapshot: engine.Snapshot,
    placement: model.Placement,
) -> bool:
    """A training gang waits for fewer racks (:func:`engine.waits_for_fewer_racks`) up to its
    ``spec.placement.localityWaitSeconds``, counted from the first cycle that could have placed
    it spread; meanwhile other gangs may take the cards (nothing is held for it), and once the
    wait is over it takes the fewest racks of what is free. As Slurm's
    ``--switches=N@max-time``: a collective-heavy job pays for every extra rack on every
    step."""
    wait = locality_wait(item.workload)
    now = clock.SYSTEM.monotonic()
    spread = engine.waits_for_fewer_racks(snapshot, placement, wait, cycle.memory.spread_since, now)
    if spread is None:
        return False
    _, fewest = spread
    note_reason(
        cycle,
        item,
        model.Reason(
            FEWER_RACKS,
            f"the free cards would spread it over more racks than the {fewest} that could hold"
            f" it: it waits up to {wait} s for them (spec.placement.localityWaitSeconds)",
        ),
    )
    return True


def locality_wait(workload: Workload) -> int:
    job = workload.model
    return (
        job.spec.placement.locality_wait_seconds if isinstance(job, trainingjob.TrainingJob) else 0
    )


def growable(cycle: cyclestate.CycleState) -> list[Workload]:
    """Shrunk training jobs that may grow back here (time-sharing grows its own; a
    finished job never does)."""
    found = []
    for workload in cycle.world.workloads:
        if not isinstance(workload.model, trainingjob.TrainingJob):
            continue
        if cycle.effective(workload) >= workload.model.spec.replicas:
            continue
        if cycle.shares.governs(workload.key) or read_model.succeeded(cycle.world, workload):
            continue
        found.append(workload)
    return found


async def grow(
    cycle: cyclestate.CycleState,
    snapshot: engine.Snapshot,
    waiting: int | None,
    growable: Sequence[Workload],
) -> None:
    """Rule: a shrunk elastic job (of ``growable``) grows back to spec.replicas once the
    whole gang fits again on free cards, and no gang of its priority or higher still waits
    for cards."""
    for workload in growable:
        assert isinstance(workload.model, trainingjob.TrainingJob)
        spec = workload.model.spec
        if waiting is not None and waiting >= spec.priority:
            continue
        size = cycle.sizes.get(spec.super_node or "") or max(cycle.sizes.values(), default=0)
        full = gangs.training_gang(
            workload.namespace,
            workload.name,
            spec,
            size,
            card_resource=cycle.card_resource(workload),
        )
        verdict = engine.place(snapshot, full.request)
        if isinstance(verdict, model.Placement):
            snapshot.commit(verdict)
            await cycle.set_replicas(workload, spec.replicas)
            cycle.event(workload, "Normal", "Grown", f"grown back to {spec.replicas} replicas")


def nominated(cycle: cyclestate.CycleState, gang: str) -> bool:
    """Whether ``gang`` preempted within :data:`NOMINATION_SECONDS` and has not bound."""
    at = cycle.memory.nominated.get(gang)
    if at is not None and clock.SYSTEM.monotonic() - at > NOMINATION_SECONDS:
        del cycle.memory.nominated[gang]
        return False
    return at is not None


def note_reason(
    cycle: cyclestate.CycleState, item: cyclestate.Pending, reason: model.Reason
) -> None:
    """Remember why a gang waits; a Warning Event when the reason is new."""
    key = item.gang.request.gang
    if cycle.memory.reasons.get(key) != reason:
        cycle.event(item.workload, "Warning", reason.code, f"gang {key}: {reason.message}")
        log.info("gang waits", gang=key, reason=reason.code, message=reason.message)
    cycle.memory.reasons[key] = reason
