"""A new gang's pod manifests are made when it is bound (or its pods are created unplaced),
not in every cycle it waits: at 64 supernodes a burst of 1,024 jobs waited through ~25
cycles of 96 pods each, and making every waiting gang's manifests each cycle was a third of
the scheduling cycle."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate, gangpods, placement
from matrixpool.k8s import pods
from matrixpool.state import assumed as assuming
from tests.unit.recorder import Recorder
from tests.unit.worlds import fixed_world, job


def test_only_the_gangs_bound_this_cycle_get_their_manifests_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[str] = []
    manifest = pods.manifest

    def counting(plan: Any, *args: Any) -> dict[str, Any]:
        made.append(plan.name)
        return manifest(plan, *args)

    monkeypatch.setattr(pods, "manifest", counting)
    monkeypatch.setattr(placement, "PODS_PER_CYCLE", 2)  # two 1-pod gangs a cycle

    async def scenario() -> None:
        act = Recorder()
        memory = cyclestate.Memory()
        seen = fixed_world({}, [job(f"j{i}", 1) for i in range(6)], nodes=8)
        await scheduler.run_cycle(lambda: seen, memory, assuming.Assumed(), act)
        bound = sorted(act.bound_to)
        assert len(bound) == 2  # the budget: the other four wait, deferred
        assert sorted(made) == sorted(n.split("/", 1)[1] for n in bound)  # theirs alone
        assert sorted(p["metadata"]["name"] for p in act.created) == sorted(made)

    asyncio.run(scenario())


def test_a_lazy_mapping_is_made_once_on_its_first_read() -> None:
    calls: list[int] = []

    def make() -> dict[str, dict[str, Any]]:
        calls.append(1)
        return {"a-0": {"metadata": {"name": "a-0"}}}

    lazy = gangpods.Lazy(make)
    assert calls == []
    assert list(lazy) == ["a-0"]
    assert len(lazy) == 1
    assert lazy["a-0"]["metadata"]["name"] == "a-0"
    assert calls == [1]
