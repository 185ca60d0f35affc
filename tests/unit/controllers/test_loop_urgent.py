"""The main loop's pass (controllers.loop.one_pass) stops at its next step when a node fault is
stamped meanwhile (controllers.wake), so the next pass, which begins with recovery, comes at
once instead of after the rest of a pass that takes seconds at 64 supernodes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from matrixpool.controllers import loop, wake
from matrixpool.controllers.scheduling import cycle as scheduler
from tests.unit.recorder import Recorder
from tests.unit.worlds import fixed_world, index, job, running


def test_a_fault_stamped_during_a_pass_stops_it_before_the_scheduling_cycle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alarm = wake.Wake()
    steps: list[str] = []

    async def autoscale(*_: Any) -> None:
        steps.append("autoscaler")
        alarm.node_faults("n3", ["down"])  # the watch delivers a fault while this step runs

    async def experts(*_: Any) -> None:
        steps.append("experts")

    monkeypatch.setattr(loop.autoscaler, "run", autoscale)
    monkeypatch.setattr(loop.experts, "run", experts)

    async def scenario() -> None:
        act = Recorder()
        state = loop.Controllers(act=act)
        seen = fixed_world({}, [job("a", 1)])
        await loop.one_pass(state, lambda: seen, alarm)
        assert steps == ["autoscaler"]  # stopped at the next step
        assert act.created == []
        assert state.cycle.binding is None
        assert alarm.urgent
        assert alarm.event.is_set()
        await loop.one_pass(state, lambda: seen, alarm)  # begins calm, with recovery
        assert steps == ["autoscaler", "autoscaler", "experts"]  # the same fault: no stop
        assert not alarm.urgent
        await scheduler.settle(state.cycle)
        assert [p["metadata"]["name"] for p in act.created] == ["a-0"]  # placed this time
        assert state.unreported  # its binding cycle ran apart: the next pass reports first
        await loop.one_pass(state, lambda: seen, alarm)
        assert {s["name"] for s in act.cluster_statuses} == {"sn-a"}
        assert not state.unreported

    asyncio.run(scenario())


def test_a_gang_that_came_during_a_binding_cycle_is_placed_before_the_owed_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pass after a binding cycle runs its own scheduling cycle first, then writes the
    status the binding cycle left owed (before, the report came first and the new gang waited
    for it); a binding cycle that pass started leaves its own status owed."""
    steps: list[str] = []
    reporting, cycling = loop.report, loop.scheduler.run_cycle

    async def report(*args: Any) -> None:
        steps.append("report")
        await reporting(*args)

    async def run_cycle(*args: Any, **kwargs: Any) -> bool:
        steps.append("cycle")
        return await cycling(*args, **kwargs)

    monkeypatch.setattr(loop, "report", report)
    monkeypatch.setattr(loop.scheduler, "run_cycle", run_cycle)

    class Held(Recorder):
        """Bindings wait until the test lets them through."""

        through = asyncio.Event()

        async def bind(self, bindings: Any) -> Any:
            await self.through.wait()
            return await super().bind(bindings)

    async def scenario() -> None:
        act = Held()
        act.through.set()
        state = loop.Controllers(act=act)
        seen = fixed_world({}, [job("a", 1)])
        await loop.one_pass(state, lambda: seen, None)
        assert steps == ["cycle"]  # a's binding cycle runs apart: its status is owed
        assert state.unreported
        await scheduler.settle(state.cycle)
        steps.clear()
        act.through.clear()  # b's Binding waits
        later = fixed_world(index(*running("a", 1)), [job("a", 1), job("b", 1)])
        await loop.one_pass(state, lambda: later, None)
        assert steps == ["cycle", "report"]
        assert [p["metadata"]["name"] for p in act.created] == ["a-0", "b-0"]
        assert {s["name"] for s in act.cluster_statuses} == {"sn-a"}
        assert state.unreported  # b's binding cycle: its status comes after it
        act.through.set()
        await scheduler.settle(state.cycle)
        await loop.one_pass(state, lambda: later, None)
        assert steps == ["cycle", "report", "cycle", "report"]
        assert not state.unreported

    asyncio.run(scenario())
