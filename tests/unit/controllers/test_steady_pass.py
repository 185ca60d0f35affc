"""What a steady pass no longer does at 32 supernodes (benchmarks/scale.py): build the placement
snapshot when nothing waits to be placed or grown, and copy the indexes at each of its reads."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from matrixpool.controllers import loop
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.placement import engine
from matrixpool.state import assumed as assuming
from matrixpool.state import world
from tests.unit.clocks import Ticking
from tests.unit.recorder import Recorder
from tests.unit.worlds import fixed_world, index, job, pod, running


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the placement snapshots built."""
    built: list[int] = []
    real = engine.Snapshot.build

    def counted(*args: Any, **kwargs: Any) -> engine.Snapshot:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.Snapshot, "build", staticmethod(counted))
    return built


def cycle(seen: world.World) -> Recorder:
    executor = Recorder()
    asyncio.run(scheduler.Cycle(seen, cyclestate.Memory(), assuming.Assumed(), executor).run())
    return executor


def test_a_cycle_with_nothing_to_place_or_grow_builds_no_snapshot(builds: list[int]) -> None:
    executor = cycle(fixed_world(index(*running("steady", 2)), [job("steady", 2)]))
    assert builds == []
    assert executor.reserved == []


def test_a_gang_that_waits_is_placed_from_a_snapshot(builds: list[int]) -> None:
    executor = cycle(fixed_world(index(pod("new-0", "u0"), pod("new-1", "u1")), [job("new", 2)]))
    assert builds == [1]
    assert sorted(name for _, name, _, _ in executor.reserved) == ["new-0", "new-1"]


def test_a_shrunk_elastic_job_is_still_grown_when_nothing_waits(builds: list[int]) -> None:
    shrunk = job("elastic", 4, minReplicas=2, status={"replicas": {"desired": 2}})
    executor = cycle(fixed_world(index(*running("elastic", 2)), [shrunk]))
    assert builds == [1]
    assert "Grown" in executor.reasons("elastic")


def test_a_pass_copies_the_indexes_once_and_again_when_older_than_a_tick(
    ticking: Ticking,
) -> None:
    taken: list[float] = []

    def take() -> loop.Copied:
        taken.append(ticking.at)
        return loop.Copied(ticking.at, {}, {}, frozenset(), {}, [], {}, [], frozenset())

    copies = loop.Copies()
    first = copies.get(take)
    ticking.at += loop.CYCLE_SECONDS / 2
    assert copies.get(take) is first  # the same pass, within a tick: read again, not copied
    ticking.at += loop.CYCLE_SECONDS  # a pass that waited on its API calls
    assert copies.get(take) is not first
    copies.clear()  # the next pass
    copies.get(take)
    assert len(taken) == 3
