"""The binding cycle apart from the scheduling cycle (controllers.scheduling.cycle.run_cycle with
``background``): the scheduling cycle returns once it has decided, its bindings are written
by a task, and no scheduling cycle runs until they are through. No API server
(tests/unit/recorder.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace

import kubernetes
import pytest

from matrixpool.controllers import loop
from matrixpool.controllers.scheduling import binding, cyclestate
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.k8s import pods
from matrixpool.state import assumed as assuming
from matrixpool.state import world
from tests.unit.recorder import Recorder
from tests.unit.worlds import fixed_world, index, job, pod


class HeldBinds(Recorder):
    """Bindings wait for :attr:`gate`; with :attr:`fail`, the first Binding call raises."""

    gate: asyncio.Event
    fail: bool = False

    async def bind(self, bindings: Sequence[pods.PodBinding]) -> list[pods.Outcome]:
        await self.gate.wait()
        if self.fail:
            self.fail = False
            raise ConnectionError("the API server went away")
        return await super().bind(bindings)


def two_jobs() -> world.World:
    return fixed_world({}, [job("a", 2), job("b", 1)])


def test_the_cycle_returns_before_its_bindings_and_the_next_waits_for_them() -> None:
    async def scenario() -> None:
        act = HeldBinds()
        act.gate = asyncio.Event()
        memory, assumed = cyclestate.Memory(), assuming.Assumed()
        seen = two_jobs()
        assert await scheduler.run_cycle(lambda: seen, memory, assumed, act, background=True)
        for _ in range(100):  # the binding cycle starts: pods created, reserved
            await asyncio.sleep(0)
        assert len(act.created) == 3
        assert act.bound_to == {}  # held at the gate
        assert memory.binding is not None
        assert not memory.binding.done()
        created = len(act.created)
        # A second cycle while the bindings are written decides nothing and writes nothing.
        ran = await scheduler.run_cycle(lambda: seen, memory, assumed, act, background=True)
        assert ran is False
        assert len(act.created) == created
        act.gate.set()
        await scheduler.settle(memory)
        assert sorted(act.bound_to) == ["ns/a-0", "ns/a-1", "ns/b-0"]
        assert {s["name"] for s in act.statuses} == {"a", "b"}  # phase 7 ran after the binds
        assert await scheduler.run_cycle(lambda: seen, memory, assumed, act, background=True)

    asyncio.run(scenario())


def test_a_failed_binding_cycle_is_logged_and_the_next_cycle_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        act = HeldBinds()
        act.gate = asyncio.Event()
        act.gate.set()
        act.fail = True
        memory, assumed = cyclestate.Memory(), assuming.Assumed()
        seen = fixed_world({}, [job("a", 2)])
        assert await scheduler.run_cycle(lambda: seen, memory, assumed, act, background=True)
        await scheduler.settle(memory)
        assert memory.binding is not None
        assert memory.binding.exception() is None  # caught and logged, not raised
        assert act.bound_to == {}
        assert await scheduler.run_cycle(lambda: seen, memory, assumed, act, background=True)
        await scheduler.settle(memory)

    asyncio.run(scenario())


def test_without_background_the_cycle_returns_with_its_bindings_written() -> None:
    async def scenario() -> None:
        act = HeldBinds()
        act.gate = asyncio.Event()
        act.gate.set()
        memory = cyclestate.Memory()
        assert await scheduler.run_cycle(lambda: two_jobs(), memory, assuming.Assumed(), act)
        assert sorted(act.bound_to) == ["ns/a-0", "ns/a-1", "ns/b-0"]
        assert memory.binding is None

    asyncio.run(scenario())


def test_a_cycle_with_nothing_to_bind_reports_at_once_and_leaves_no_task() -> None:
    """A loop that waited for a binding cycle after every pass would never rest."""

    async def scenario() -> None:
        act = HeldBinds()
        act.gate = asyncio.Event()  # never set: a Binding would hang the test
        memory = cyclestate.Memory()
        seen = fixed_world({}, [job("big", 9)])  # 9 nodes' worth on 4 nodes: waits
        ran = await scheduler.run_cycle(
            lambda: seen, memory, assuming.Assumed(), act, background=True
        )
        assert ran
        assert memory.binding is None
        assert act.bound_to == {}
        assert [s["name"] for s in act.statuses] == ["big"]  # its status says it waits

    asyncio.run(scenario())


class BoundElsewhere(Recorder):
    """Every Binding answers that the pod is bound elsewhere: the reservation is released and
    the next cycle places the gang again, in a binding cycle again."""

    async def bind(self, bindings: Sequence[pods.PodBinding]) -> list[pods.Outcome]:
        return [pods.BoundElsewhereError(name) for _, name, _, _ in bindings]


def test_the_status_is_written_after_each_binding_cycle_even_when_every_cycle_binds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gang that keeps failing to bind starts a binding cycle every pass; the SuperNode
    status (the rest of the pass that started it) must still be written, once it has waited
    ``loop.REPORT_DEFERRED_SECONDS`` for a pass that binds nothing."""
    now = [50.0]
    monkeypatch.setattr(loop.clock.SYSTEM, "monotonic", lambda: now[0])

    async def scenario() -> None:
        act = BoundElsewhere()
        state = loop.Controllers(act=act)
        seen = fixed_world(index(pod("a-0", "u0")), [job("a", 1)])
        for tried in range(1, 4):
            assert act.cluster_statuses == []  # owed since the first pass, for < the bound
            await loop.one_pass(state, lambda: seen)
            assert state.cycle.binding is not None  # this pass started a binding cycle
            await scheduler.settle(state.cycle)
            assert len(act.reserved) == tried
            now[0] += loop.REPORT_DEFERRED_SECONDS / 2
        assert {s["name"] for s in act.cluster_statuses} == {"sn-a"}  # written

    asyncio.run(scenario())


def test_a_binding_answered_404_forgets_the_pod_the_operator_created() -> None:
    """A pod created reserved and deleted before the index showed it (CI of 9a7867f: a
    regroup's new pods under load): its Binding answers 404, and the view drops it at once
    instead of showing the gang half reserved for ``assumed.CREATED_SECONDS``, each cycle
    clearing the reservation of a pod that is not there."""
    made = pod("a-0", "u0", reserved_node="n0", cards=frozenset({0}))
    kept = pod("a-1", "u1", reserved_node="n1", cards=frozenset({0}))
    held = assuming.Assumed()
    for p in (made, kept):
        held.made(p)
    cycle = SimpleNamespace(assumed=held)
    missing = kubernetes.client.ApiException(status=404, reason="Not Found")
    assert not binding.note_bound(cycle, made, "n0", frozenset({0}), missing)  # type: ignore[arg-type]
    refused = kubernetes.client.ApiException(status=500, reason="Internal Server Error")
    assert not binding.note_bound(cycle, kept, "n1", frozenset({0}), refused)  # type: ignore[arg-type]
    seen = held.view({})
    assert [p.name for p in seen["ns/a"]] == ["a-1"]  # a 500 leaves the pod to the next cycle


def test_a_binding_refused_because_the_pod_was_made_again_forgets_the_old_pod() -> None:
    """The Binding carries the pod's UID; a pod deleted and made again under its name since
    the cycle decided is another pod (pods.ReplacedError): the old one is dropped from the
    view, and the new one is left to the index and the next cycle."""
    made = pod("a-0", "u0", reserved_node="n0", cards=frozenset({0}))
    held = assuming.Assumed()
    held.made(made)
    cycle = SimpleNamespace(assumed=held)
    replaced = pods.ReplacedError("pod ns/a-0 is another pod now (UID u9)")
    assert not binding.note_bound(cycle, made, "n0", frozenset({0}), replaced)  # type: ignore[arg-type]
    assert held.view({}) == {}
