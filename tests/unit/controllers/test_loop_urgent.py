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
from tests.unit.worlds import fixed_world, job


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
