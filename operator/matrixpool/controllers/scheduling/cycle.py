"""The scheduling cycle: keeps the pods of every gang in existence, places whole gangs onto
cards with the pure engine, binds them, preempts lower priorities, and reports status.

One cycle runs at a time for the whole operator: the main loop (:mod:`matrixpool.controllers.loop`)
calls :func:`run_cycle` on one read model (:mod:`matrixpool.state.world`), whose assumed
holdings count what earlier cycles reserved and bound until the watch shows it, so no card can
be given twice. Binding is two-phase (reserve every pod of the gang, then bind each; see
:mod:`matrixpool.k8s.pods`), so an operator killed at any moment comes back, rebuilds the
holdings from the pods' annotations, and finishes or undoes a half-bound gang.

The main loop runs phases 6 and 7 as a binding cycle apart from the scheduling cycle (as
kube-scheduler does): the scheduling cycle decides, its binding cycle writes in the background
while the loop's recovery goes on, and the next scheduling cycle (and the controllers that read
what bindings write: time-sharing, the SuperNode status) starts only once that binding cycle is
through, so a decision never rests on a world that lacks the last cycle's writes. A cycle
with nothing to bind reports at once. ``matrixpool_cycle_seconds`` times the scheduling cycle,
``matrixpool_gang_bind_seconds`` the bindings.

Cycle phases (:class:`Cycle`; each phase is a function of the module named): 1 read the world
(:class:`.cyclestate.CycleState`, and the KV-cache admission: :mod:`.kvadmission`), 2 the gangs
each workload wants, 3 create missing pods and delete surplus ones (a finished job's pods are
kept until its ttl: :mod:`matrixpool.controllers.lifecycle`) (both :mod:`.gangpods`), 4 finish
or undo half-done bindings (:mod:`.binding`), 4b victims of a preemption that checkpointed (or
ran out of grace) give up their pods (:mod:`.preemption`), 5 place pending gangs highest
priority first (preempting if needed: training that checkpoints is asked first;
:mod:`.placement`), 6 reserve and bind (:mod:`.binding`), 7 write each workload's status,
composed once (:mod:`.status`, which also holds the table of who writes which status field).
Every action goes through the executor the cycle is given (:mod:`matrixpool.k8s.executor`), so
the cycle's plans are unit-tested with a recording one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import structlog

from matrixpool import metrics
from matrixpool.controllers.scheduling import (
    binding,
    cyclestate,
    gangpods,
    kvadmission,
    placement,
    preemption,
    status,
)
from matrixpool.k8s import executor
from matrixpool.placement import gangs, model
from matrixpool.state.assumed import Assumed
from matrixpool.state.world import World

log = structlog.get_logger(__name__)


async def run_cycle(
    world_reader: Any,
    memory: cyclestate.Memory,
    assumed: Assumed,
    act: executor.Executor,
    *,
    background: bool = False,
) -> bool:
    """Run one cycle; ``world_reader()`` → World. Serialized by a lock, as a safety net.
    What the cycle reserves, binds and deletes goes into ``assumed``; ``act`` carries it out.

    ``background``: return once the scheduling cycle has decided, its binding cycle left to
    run as a task (``memory.binding``) when it has gangs to bind. False when no cycle ran
    because the last one's binding cycle is still writing."""
    async with memory.lock:
        if memory.binding is not None:
            if not memory.binding.done():
                return False
            memory.binding = None
        cycle = Cycle(world_reader(), memory, assumed, act)
        with metrics.CYCLE_SECONDS.time():
            decided = await cycle.schedule()
        if not background or not decided[1]:  # nothing to bind: report at once
            await cycle.finish(*decided)
            return True
        memory.binding = asyncio.create_task(_binding_cycle(cycle, decided))
        return True


async def _binding_cycle(
    cycle: Cycle,
    decided: tuple[Mapping[str, list[gangs.Gang]], list[cyclestate.Binding], set[model.GangKey]],
) -> None:
    try:
        await cycle.finish(*decided)
    except Exception:  # the next cycle finishes or undoes what this one left half done
        log.exception("binding cycle failed; the next cycle retries")


async def settle(memory: cyclestate.Memory) -> None:
    """Wait for the last cycle's binding cycle, if one is still writing (the loop stops)."""
    if memory.binding is not None:
        await asyncio.gather(memory.binding, return_exceptions=True)


class Cycle:
    """One pass over the world; short-lived. Its phases share :attr:`state`."""

    def __init__(
        self,
        world: World,
        memory: cyclestate.Memory,
        assumed: Assumed | None = None,
        act: executor.Executor | None = None,
    ) -> None:
        self.state = cyclestate.CycleState(world, memory, assumed, act)  # phase 1: the world
        self.state.kv = kvadmission.kv_admission(world, memory)  # ... and the KV-cache pools

    async def run(self) -> None:
        """The whole cycle: the scheduling cycle, then its binding cycle."""
        await self.finish(*await self.schedule())

    async def schedule(
        self,
    ) -> tuple[Mapping[str, list[gangs.Gang]], list[cyclestate.Binding], set[model.GangKey]]:
        """Phases 2-5: what to bind (and what each workload wants, and the new gangs tried)."""
        state = self.state
        state.memory.kv = state.kv  # for the KV quota controller (controllers.daemons)
        workloads = state.world.workloads
        wanted = {w.key: gangpods.gangs_of(state, w) for w in workloads if w.model}  # phase 2
        by_key = {w.key: w for w in workloads}
        state.by_gang = {g.request.gang: (by_key[key], g) for key, gs in wanted.items() for g in gs}
        await gangpods.reconcile_pods(state, wanted)  # phase 3
        pending = await binding.finish_half_bound(state, wanted) + state.new  # phase 4
        await preemption.finish_preemptions(state)  # phase 4b: answered, or out of grace
        bindings = await placement.place(state, pending)  # phase 5
        metrics.PENDING_GANGS.set(len(pending) - len(bindings))
        tried = {b.placement.gang for b in bindings} | state.deferred
        state.memory.preempted = state.preempted
        return wanted, bindings, tried

    async def finish(
        self,
        wanted: Mapping[str, list[gangs.Gang]],
        bindings: list[cyclestate.Binding],
        tried: set[model.GangKey],
    ) -> None:
        """Phases 6-7, the binding cycle: reserve and bind, then report."""
        state = self.state
        done = await binding.bind(state, bindings)  # phase 6
        await binding.create_unplaced(state, tried)  # phase 6b: new gangs that wait get pods
        if not state.preempted:  # after a preemption the indexes lag: report next cycle
            await status.report(state, wanted, done)  # phase 7
