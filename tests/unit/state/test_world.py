"""The read model's assumed holdings (issue 12, defect "double allocation when the index
lags"): what the operator reserved, bound or deleted counts until the pod index shows it, and a
scheduling cycle run on a lagging index never gives a card twice; and checkpoint-aware
preemption: a training victim is asked first and loses its pods on its answer. No API server:
the cycle acts through a recording executor (tests/unit/recorder.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.controllers.scheduling import cyclestate, preemption
from matrixpool.k8s import daemonclient
from matrixpool.state import assumed as assuming
from matrixpool.state import decisions as decided
from matrixpool.state import world
from matrixpool_recovery import restore as restore_codec
from tests.unit.recorder import Recorder
from tests.unit.worlds import EIGHT, fixed_world, held, index, job, pod


def test_a_reservation_the_index_does_not_show_yet_is_seen_as_made() -> None:
    assumed = assuming.Assumed()
    fresh = pod("a-0", "u1")
    assumed.reserved(fresh, "n1", EIGHT)
    (seen,) = assumed.view(index(fresh))["ns/a"]
    assert (seen.reserved_node, seen.cards, seen.holds_cards) == ("n1", EIGHT, True)
    assert len(assumed) == 1


def test_a_binding_is_assumed_until_the_index_shows_the_pod_bound_there() -> None:
    assumed = assuming.Assumed()
    fresh = pod("a-0", "u1")
    assumed.reserved(fresh, "n1", EIGHT)
    assumed.bound(fresh, "n1", EIGHT)
    reserved = dataclasses.replace(fresh, reserved_node="n1", cards=EIGHT)
    (seen,) = assumed.view(index(reserved))["ns/a"]
    assert seen.node == "n1", "the reservation alone does not end a binding's assumption"
    bound = dataclasses.replace(reserved, node="n1")
    assumed.view(index(bound))
    assert len(assumed) == 0


def test_a_binding_keeps_its_cards_when_a_read_ended_the_reservation_before_it() -> None:
    """Reserve, a read whose index shows the reservation (the reservation's assumption ends),
    then the Binding goes through: the pod is seen bound with its cards, not without them."""
    assumed = assuming.Assumed()
    unplaced = pod("a-0", "u1")  # as the cycle saw it: no node, no cards
    assumed.reserved(unplaced, "n1", EIGHT)
    reserved = dataclasses.replace(unplaced, reserved_node="n1", cards=EIGHT)
    assumed.view(index(reserved))
    assert len(assumed) == 0
    assumed.bound(unplaced, "n1", EIGHT)
    (seen,) = assumed.view(index(reserved))["ns/a"]
    assert (seen.node, seen.cards, seen.holds_cards) == ("n1", EIGHT, True)


@pytest.mark.parametrize(
    ("shown", "left"),
    [
        pytest.param(None, 0, id="a pod gone from the index ends its assumption"),
        pytest.param({"node": "n2", "cards": EIGHT}, 0, id="a pod bound elsewhere ends it"),
        pytest.param({"reserved_node": "n1"}, 1, id="a reservation without cards does not"),
    ],
)
def test_when_an_assumption_ends(shown: dict[str, Any] | None, left: int) -> None:
    assumed = assuming.Assumed()
    fresh = pod("a-0", "u1")
    assumed.reserved(fresh, "n1", EIGHT)
    assumed.view(index() if shown is None else index(dataclasses.replace(fresh, **shown)))
    assert len(assumed) == left


def test_a_deleted_pod_is_seen_terminating_until_the_index_shows_it() -> None:
    assumed = assuming.Assumed()
    victim = pod("a-0", "u1", node="n1", cards=EIGHT)
    assumed.deleting(victim)
    assert assumed.view(index(victim))["ns/a"][0].deleting
    assumed.view(index(dataclasses.replace(victim, deleting=True)))
    assert len(assumed) == 0


def test_a_pod_created_again_under_its_name_is_another_pod() -> None:
    assumed = assuming.Assumed()
    assumed.reserved(pod("a-0", "u1"), "n1", EIGHT)
    (seen,) = assumed.view(index(pod("a-0", "u1"), pod("b-0", "u2")))["ns/a"]
    assert seen.holds_cards
    (other,) = assumed.view(index(pod("a-0", "u3")))["ns/a"]
    assert not other.holds_cards
    assert len(assumed) == 0


# ---- a whole cycle on a lagging index ------------------------------------------------------


def test_a_cycle_on_an_index_that_never_catches_up_gives_no_card_twice() -> None:
    executor = Recorder()
    first = job("first", 2)
    stale = index(pod("first-0", "p0"), pod("first-1", "p1"))  # what the watch shows, forever
    assumed = assuming.Assumed()
    memory = cyclestate.Memory()
    for _ in range(3):
        seen = fixed_world(assumed.view(stale), [first])
        asyncio.run(scheduler.Cycle(seen, memory, assumed, executor).run())
    assert len(executor.reserved) == 2, "the gang was reserved once, not once per cycle"
    assert set(executor.bound_to) == {"ns/first-0", "ns/first-1"}

    # A second job arrives while the watch still shows the first one unplaced: its pods get
    # the two nodes the first job does not hold.
    second = job("second", 2)
    stale |= index(pod("second-0", "q0"), pod("second-1", "q1"))
    seen = fixed_world(assumed.view(stale), [first, second])
    asyncio.run(scheduler.Cycle(seen, memory, assumed, executor).run())
    held = [(node, cards) for _, _, node, cards in executor.reserved]
    assert len(held) == len(set(held)) == 4, f"a card reserved twice: {held}"


# ---- checkpoint-aware preemption -----------------------------------------------------------


def test_a_preempted_training_job_is_asked_to_checkpoint_and_evicted_on_its_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = Recorder()
    monkeypatch.setattr(preemption, "CHECK_SECONDS", 0.0)
    calls.inventories["uid-low"] = daemonclient.Inventory(
        (held("uid-low", 4, 0, "n0"), held("uid-low", 4, 1, "n1"))
    )
    low = job("low", 2, priority=10, checkpoint=True, status={"checkpoints": {"memory": 4}})
    high = job("high", 4, priority=500)
    facts = index(
        *(
            pod(f"low-{r}", f"l{r}", node=f"n{r}", cards=EIGHT, phase="Running", world=2)
            for r in range(2)
        ),
        *(pod(f"high-{r}", f"h{r}") for r in range(4)),
    )
    decisions, memory, assumed = decided.Decisions(), cyclestate.Memory(), assuming.Assumed()

    async def cycles(count: int) -> None:
        for _ in range(count):
            seen = dataclasses.replace(
                fixed_world(assumed.view(facts), [low, high]), decisions=decisions
            )
            await scheduler.Cycle(seen, memory, assumed, calls).run()
            await asyncio.sleep(0.01)  # the daemons' answer comes in the background

    asyncio.run(cycles(3))
    assert {name for name, _ in calls.annotated} == {"ns/low-0", "ns/low-1"}
    assert "uid-low" in decisions.preempting, "asked, waiting for the answer"
    assert calls.deleted == [], "no pod goes before the answer (step 4 was there before)"
    assert memory.reasons["ns/high"].code == "WaitingForCheckpoint"

    calls.inventories["uid-low"] = daemonclient.Inventory(  # the answer
        (held("uid-low", 6, 0, "n0"), held("uid-low", 6, 1, "n1"))
    )
    asyncio.run(cycles(2))
    assert sorted(calls.deleted) == ["ns/low-0", "ns/low-1"]
    assert decisions.preempting == {}
    preempted = [
        c
        for s in calls.statuses
        for c in s.get("conditions") or []
        if s["name"] == "low" and c["type"] == "Preempted"
    ]
    assert "checkpoint answered at step 6" in preempted[-1]["message"]
    asyncio.run(cycles(2))  # the index never shows the condition: it is not lost for that
    last = [s for s in calls.statuses if s["name"] == "low" and "phase" in s][-1]
    kept = {c["type"]: c["status"] for c in last["conditions"]}
    assert kept["Preempted"] == "True", last["conditions"]
    assert last["phase"] == "Suspended"
    (record,) = calls.status_of("low", "preemptions")[-1]
    assert (record["checkpoint"], record["step"], record["requestId"]) == (
        "Answered",
        6,
        calls.annotated[0][1]["matrixpool.dev/checkpoint-request"],
    )
    assert record["worldSize"] == 2  # the world that wrote step 6
    assert calls.created == [], "no new pod while the evicted ones are going"

    # The evicted pods are gone; their trainers committed step 8 before they stopped. The new
    # pods are created once the daemons said so (asked in the background), told to restore 8.
    calls.inventories["uid-low"] = daemonclient.Inventory(
        (held("uid-low", 8, 0, "n0"), held("uid-low", 8, 1, "n1"))
    )
    facts = index(*(pod(f"high-{r}", f"h{r}") for r in range(4)))
    asyncio.run(cycles(3))
    created = {m["metadata"]["name"]: m["metadata"] for m in calls.created}
    assert set(created) == {"low-0", "low-1"}
    told = restore_codec.parse_restore(created["low-0"]["annotations"]["matrixpool.dev/restore"])
    assert told is not None
    assert (told.step, told.recovery) == (8, f"preempt-{record['requestId']}")


def test_training_without_checkpoints_and_inference_give_up_their_cards_at_once() -> None:
    cycle = cyclestate.CycleState(fixed_world({}, []), cyclestate.Memory())
    assert preemption.checkpoint_grace(cycle, job("plain", 2)) is None
    running = fixed_world(index(pod("saver-0", "s0", node="n0", phase="Running")), [])
    saver = job("saver", 1, checkpoint=True)
    busy = cyclestate.CycleState(running, cyclestate.Memory())
    assert preemption.checkpoint_grace(busy, saver) == 60.0


def test_topologies_are_kept_while_nodes_and_supernodes_stay_equal_and_rebuilt_on_change() -> None:
    """world.Derived: the loop's passes share one; equal inputs give the same slots without a
    rebuild, a node going down or a spec change gives a new answer, never a stale one."""
    derived = world.Derived()
    first = dataclasses.replace(fixed_world({}, []), derived=derived)
    topology = world.topologies(first)
    assert [s.name for s in topology[0].nodes] == ["n0", "n1", "n2", "n3"]
    again = dataclasses.replace(fixed_world({}, []), derived=derived)  # equal, new objects
    assert world.topologies(again)[0] is topology[0], "kept"
    down = dataclasses.replace(fixed_world({}, [], down=frozenset({"n2"})), derived=derived)
    slots = {s.name: s for s in world.topologies(down)[0].nodes}
    assert slots["n2"].usable == frozenset()
    assert len(slots["n0"].usable) == 8
    spared = dataclasses.replace(fixed_world({}, [], spares=1), derived=derived)
    assert world.topologies(spared)[0].spares == 1
    stale = dataclasses.replace(spared, stale=frozenset({"n1"}))
    assert {s.name: s for s in world.topologies(stale)[0].nodes}["n1"].usable == frozenset()
    assert world.members(stale)["sn-a"] == stale.nodes
    fewer = dataclasses.replace(fixed_world({}, [], nodes=2), derived=derived)
    assert [n.name for n in world.members(fewer)["sn-a"]] == ["n0", "n1"]
