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


class Held(Recorder):
    """Bindings wait until the test lets them through."""

    def __init__(self) -> None:
        super().__init__()
        self.through = asyncio.Event()

    async def bind(self, bindings: Any) -> Any:
        await self.through.wait()
        return await super().bind(bindings)


def recorded_steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The order in which a pass runs its scheduling cycle and its status report."""
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
    return steps


def test_a_gang_that_came_during_a_binding_cycle_is_placed_before_the_owed_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pass after a binding cycle runs its own scheduling cycle first; when that cycle
    starts a binding cycle again, the status the first one left owed waits for a pass that
    binds nothing (before, the report came first and the new gang waited for it; then it was
    written beside the new binding cycle and slowed its creates)."""
    steps = recorded_steps(monkeypatch)

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
        assert steps == ["cycle"]  # b's binding cycle writes alone
        await asyncio.sleep(0.01)  # its task creates b's pods, then waits at the Binding
        assert [p["metadata"]["name"] for p in act.created] == ["a-0", "b-0"]
        assert act.cluster_statuses == []
        assert state.unreported
        act.through.set()
        await scheduler.settle(state.cycle)
        await loop.one_pass(state, lambda: later, None)  # binds nothing: the report comes
        assert steps == ["cycle", "cycle", "report"]
        assert {s["name"] for s in act.cluster_statuses} == {"sn-a"}
        assert not state.unreported

    asyncio.run(scenario())


def test_an_owed_report_waits_for_binding_cycles_at_most_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While gangs keep coming, every pass starts a binding cycle: the owed report waits
    ``REPORT_DEFERRED_SECONDS`` at most, then is written beside the binding cycle, and the
    status that binding cycle leaves owed waits afresh."""
    steps = recorded_steps(monkeypatch)
    now = [1000.0]
    monkeypatch.setattr(loop.clock.SYSTEM, "monotonic", lambda: now[0])

    async def scenario() -> None:
        act = Held()
        act.through.set()
        state = loop.Controllers(act=act)
        jobs = [job("a", 1)]
        await loop.one_pass(state, lambda: fixed_world({}, jobs), None)
        await scheduler.settle(state.cycle)
        assert steps == ["cycle"]
        assert state.unreported
        pods: dict[str, Any] = index(*running("a", 1))
        for name in ("b", "c"):  # a new gang at every pass, short of the bound
            now[0] += loop.REPORT_DEFERRED_SECONDS / 3
            jobs.append(job(name, 1))
            seen = fixed_world(pods, list(jobs))
            await loop.one_pass(state, lambda seen=seen: seen, None)
            await scheduler.settle(state.cycle)
            pods = {**pods, **index(*running(name, 1))}
        assert steps == ["cycle", "cycle", "cycle"]
        assert act.cluster_statuses == []
        now[0] += loop.REPORT_DEFERRED_SECONDS / 3  # the bound: written beside d's bindings
        jobs.append(job("d", 1))
        act.through.clear()
        seen = fixed_world(pods, list(jobs))
        await loop.one_pass(state, lambda: seen, None)
        assert steps[-2:] == ["cycle", "report"]
        assert {s["name"] for s in act.cluster_statuses} == {"sn-a"}
        assert state.unreported  # d's status: owed from now
        assert state.owed_since == now[0]
        assert not state.report_overdue()
        act.through.set()
        await scheduler.settle(state.cycle)

    asyncio.run(scenario())


def test_a_pass_yields_between_its_steps_only_once_a_yield_is_due(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A yield costs a millisecond (a timer): between steps shorter than that, a pass looks at
    the alarm without one; once ``YIELD_AFTER_SECONDS`` went since the last, it yields."""
    slept: list[float] = []
    sleeping = asyncio.sleep

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await sleeping(0)

    monkeypatch.setattr(loop.asyncio, "sleep", sleep)

    async def scenario() -> None:
        alarm = wake.Wake()
        paced = loop.Paced(alarm)
        assert not await paced.fault_came()  # the pass just began: no yield due
        assert slept == []
        paced.yielded -= loop.YIELD_AFTER_SECONDS
        assert not await paced.fault_came()
        assert slept == [loop.YIELD_SECONDS]
        assert not await paced.fault_came()  # it just yielded
        assert slept == [loop.YIELD_SECONDS]
        alarm.node_faults("n3", ["down"])
        assert await paced.fault_came()  # a fault is seen without a yield

    asyncio.run(scenario())
