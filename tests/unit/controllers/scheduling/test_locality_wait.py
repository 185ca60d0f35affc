"""A training gang that asks for a locality wait (``spec.placement.localityWaitSeconds``) waits,
up to that long, when the free cards would spread it over more racks than the fewest that could
hold it; other gangs take cards meanwhile; after the wait it takes what is free."""

from __future__ import annotations

import asyncio

import pytest

from matrixpool import clock
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate, placement
from matrixpool.k8s import convert
from matrixpool.state import assumed as assuming
from matrixpool.state.workloads import Workload
from tests.unit import worlds
from tests.unit.clocks import Ticking
from tests.unit.recorder import Recorder


def rack(node: str) -> int:
    return int(node.removeprefix("n")) // 2


def holding(job: str, *nodes: str) -> list[convert.PodFacts]:
    """``job``'s ranks Running on the whole of ``nodes``, one each."""
    return [
        worlds.pod(f"{job}-{r}", f"{job}-u{r}", node=n, cards=worlds.EIGHT, phase="Running")
        for r, n in enumerate(nodes)
    ]


def one_cycle(
    facts: list[convert.PodFacts], jobs: list[Workload], memory: cyclestate.Memory
) -> Recorder:
    """Racks of two nodes: n0 n1 | n2 n3 | n4 n5."""
    seen = worlds.fixed_world(worlds.index(*facts), jobs, nodes=6, racks=True)
    act = Recorder()
    asyncio.run(scheduler.Cycle(seen, memory, assuming.Assumed(), act).run())
    return act


@pytest.fixture
def ticking(monkeypatch: pytest.MonkeyPatch) -> Ticking:
    moved = Ticking()
    monkeypatch.setattr(clock, "SYSTEM", moved)
    return moved


def test_a_gang_waits_for_one_rack_then_takes_two(ticking: Ticking) -> None:
    """One node of each rack is held: two nodes are free, in two racks, where one rack could
    hold the gang. It waits 10 s, then takes the two racks."""
    held = holding("other", "n1", "n3", "n5")
    jobs = [
        worlds.job("other", 3),
        worlds.job("j", 2, placement={"localityWaitSeconds": 10}),
    ]
    memory = cyclestate.Memory()
    act = one_cycle(held, jobs, memory)
    assert act.bound_to == {}
    assert placement.FEWER_RACKS in act.reasons("j")
    ticking.at += 9.5
    assert one_cycle(held, jobs, memory).bound_to == {}
    ticking.at += 1
    act = one_cycle(held, jobs, memory)
    assert sorted(act.bound_to) == ["ns/j-0", "ns/j-1"]
    assert len({rack(n) for n in act.bound_to.values()}) == 2
    assert memory.spread_since == {}


def test_a_rack_that_frees_during_the_wait_is_taken_whole(ticking: Ticking) -> None:
    jobs = [
        worlds.job("other", 3),
        worlds.job("j", 2, placement={"localityWaitSeconds": 10}),
    ]
    memory = cyclestate.Memory()
    assert one_cycle(holding("other", "n1", "n3", "n5"), jobs, memory).bound_to == {}
    ticking.at += 3
    act = one_cycle(holding("other", "n3", "n5"), jobs, memory)  # rank 0 on n1 went
    assert {rack(n) for n in act.bound_to.values()} == {0}


def test_without_a_wait_it_takes_two_racks_at_once(ticking: Ticking) -> None:
    held = holding("other", "n1", "n3", "n5")
    act = one_cycle(held, [worlds.job("other", 3), worlds.job("j", 2)], cyclestate.Memory())
    assert len({rack(n) for n in act.bound_to.values()}) == 2


def test_others_take_cards_while_it_waits(ticking: Ticking) -> None:
    """Nothing is held for a gang that waits for fewer racks: a later one-node job is placed."""
    held = holding("other", "n1", "n3", "n5")
    jobs = [
        worlds.job("other", 3),
        worlds.job("j", 2, placement={"localityWaitSeconds": 10}),
        worlds.job("small", 1),
    ]
    act = one_cycle(held, jobs, cyclestate.Memory())
    assert list(act.bound_to) == ["ns/small-0"]


def test_a_gang_that_fits_the_fewest_racks_does_not_wait(ticking: Ticking) -> None:
    held = holding("other", "n1", "n3")
    jobs = [worlds.job("other", 2), worlds.job("j", 2, placement={"localityWaitSeconds": 10})]
    act = one_cycle(held, jobs, cyclestate.Memory())
    assert {rack(n) for n in act.bound_to.values()} == {2}
