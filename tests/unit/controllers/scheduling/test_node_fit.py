"""Placement respects the pod (issue 13), from the API's objects to the workload's condition:
nodes' allocatable, taints and cordon and other pods' requests read from the API, the room
left in the read model, and a cycle whose gang waits for cpu saying so in ``Scheduled`` and a
Warning Event. No API server (tests/unit/recorder.py)."""

from __future__ import annotations

import asyncio
import dataclasses

from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate
from matrixpool.k8s import convert
from matrixpool.placement import diagnose, inventory, nodefit
from matrixpool.state import assumed as assuming
from matrixpool.state import world
from tests.unit.recorder import Recorder
from tests.unit.worlds import CARDS, fixed_world, index, job, pod

ALLOCATABLE = {"cpu": "16", "memory": "64Gi", "pods": "110", CARDS: "8"}


def node_object(**spec: object) -> inventory.NodeInfo:
    status = {
        "allocatable": ALLOCATABLE,
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    return convert.node_info("n0", {"sn": "a"}, {}, spec, status)


def test_a_node_brings_its_allocatable_taints_and_cordon() -> None:
    info = node_object(taints=[{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}])
    assert info.allocatable == {"cpu": 16000, "memory": 64 * 1024**3, "pods": 110, CARDS: 8}
    assert info.taints == (nodefit.Taint("dedicated", "infer", "NoSchedule"),)
    assert (info.ready, info.cordoned, info.down) == (True, False, False)


def test_a_cordoned_node_takes_no_new_pod_but_is_no_fault() -> None:
    info = node_object(unschedulable=True)
    assert (info.ready, info.cordoned, info.down) == (False, True, False)


def test_pods_matrixpool_did_not_place_bring_every_request() -> None:
    spec = {
        "nodeName": "n0",
        "containers": [{"name": "c", "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}}],
    }
    assert convert.foreign_requests(spec, {"phase": "Running"}, {}) == {
        "cpu": 250,
        "memory": 1024**3,
    }
    assert convert.foreign_requests(spec, {"phase": "Succeeded"}, {}) is None
    assert convert.foreign_requests(spec, {}, {"matrixpool.dev/job": "j"}) is None


def with_allocatable(seen: world.World, **foreign: dict[str, int]) -> world.World:
    allocatable = {"cpu": 16000, "memory": 64 * 1024**3, "pods": 110, CARDS: 8}
    nodes = [dataclasses.replace(n, allocatable=allocatable) for n in seen.nodes]
    return dataclasses.replace(seen, nodes=nodes, foreign=dict(foreign))


def test_the_room_is_allocatable_less_foreign_requests_without_cards_and_pod_count() -> None:
    seen = with_allocatable(fixed_world({}, []), n0={"cpu": 4000, CARDS: 2})
    (topology,) = world.topologies(seen)
    rooms = {str(slot.name): dict(slot.room or ()) for slot in topology.nodes}
    assert rooms["n0"] == {"cpu": 12000, "memory": 64 * 1024**3}
    assert rooms["n1"]["cpu"] == 16000


def test_matrixpool_pods_carry_their_requests_into_the_holdings() -> None:
    bound = pod("a-0", "u0", node="n0", cards=frozenset({0}), requests=(("cpu", 3000),))
    (holding,) = world.holdings(fixed_world(index(bound), [job("a", 1)]))
    assert holding.requests == (("cpu", 3000),)


def test_a_gang_short_of_cpu_waits_with_a_condition_and_an_event_naming_cpu() -> None:
    template = {"spec": {"containers": [{"name": "t", "resources": {"requests": {"cpu": "20"}}}]}}
    hungry = job("hungry", 1, template=template)
    seen = with_allocatable(fixed_world(index(pod("hungry-0", "u0")), [hungry]))
    executor = Recorder()
    asyncio.run(scheduler.Cycle(seen, cyclestate.Memory(), assuming.Assumed(), executor).run())
    assert executor.reserved == []
    (conditions,) = executor.status_of("hungry", "conditions")[-1:]
    scheduled = next(c for c in conditions if c["type"] == "Scheduled")
    assert scheduled["reason"] == diagnose.INSUFFICIENT_RESOURCES
    assert "4 node(s) with insufficient cpu" in scheduled["message"]
    assert diagnose.INSUFFICIENT_RESOURCES in executor.reasons("hungry")
