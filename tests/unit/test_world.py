"""The read model's assumed holdings (issue 12, defect "double allocation when the index
lags"): what the operator reserved, bound or deleted counts until the pod index shows it, and a
scheduling cycle run on a lagging index never gives a card twice; and checkpoint-aware
preemption: a training victim is asked first and loses its pods on its answer. No API server:
the executor's calls are replaced by recorders."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from matrixpool import checkpoints
from matrixpool.api import supernode, trainingjob
from matrixpool.handlers import scheduler, world
from matrixpool.handlers.workloads import Workload
from matrixpool.k8s import convert, pods
from matrixpool.placement import inventory
from matrixpool_recovery import manifest

CARDS = "huawei.com/Ascend910"


def pod(name: str, uid: str, **extra: Any) -> convert.PodFacts:
    fields: dict[str, Any] = {
        "namespace": "ns",
        "name": name,
        "owner": name.rsplit("-", 1)[0],
        "kind": "TrainingJob",
        "role": "trainer",
        "replica": 0,
        "rank": int(name.rsplit("-", 1)[1]),
        "node": None,
        "reserved_node": None,
        "cards": frozenset(),
        "phase": "Pending",
        "deleting": False,
        "ready": False,
        "uid": uid,
    }
    fields.update(extra)
    return convert.PodFacts(**fields)


def index(*facts: convert.PodFacts) -> dict[str, list[convert.PodFacts]]:
    by_owner: dict[str, list[convert.PodFacts]] = {}
    for p in facts:
        by_owner.setdefault(f"ns/{p.owner}", []).append(p)
    return by_owner


EIGHT = frozenset(range(8))


def test_a_reservation_the_index_does_not_show_yet_is_seen_as_made() -> None:
    assumed = world.Assumed()
    fresh = pod("a-0", "u1")
    assumed.reserved(fresh, "n1", EIGHT)
    (seen,) = assumed.view(index(fresh))["ns/a"]
    assert (seen.reserved_node, seen.cards, seen.holds_cards) == ("n1", EIGHT, True)
    assert len(assumed) == 1


def test_a_binding_is_assumed_until_the_index_shows_the_pod_bound_there() -> None:
    assumed = world.Assumed()
    fresh = pod("a-0", "u1")
    assumed.reserved(fresh, "n1", EIGHT)
    assumed.bound(fresh, "n1")
    reserved = dataclasses.replace(fresh, reserved_node="n1", cards=EIGHT)
    (seen,) = assumed.view(index(reserved))["ns/a"]
    assert seen.node == "n1", "the reservation alone does not end a binding's assumption"
    bound = dataclasses.replace(reserved, node="n1")
    assumed.view(index(bound))
    assert len(assumed) == 0


@pytest.mark.parametrize(
    ("shown", "left"),
    [
        pytest.param(None, 0, id="a pod gone from the index ends its assumption"),
        pytest.param({"node": "n2", "cards": EIGHT}, 0, id="a pod bound elsewhere ends it"),
        pytest.param({"reserved_node": "n1"}, 1, id="a reservation without cards does not"),
    ],
)
def test_when_an_assumption_ends(shown: dict[str, Any] | None, left: int) -> None:
    assumed = world.Assumed()
    fresh = pod("a-0", "u1")
    assumed.reserved(fresh, "n1", EIGHT)
    assumed.view(index() if shown is None else index(dataclasses.replace(fresh, **shown)))
    assert len(assumed) == left


def test_a_deleted_pod_is_seen_terminating_until_the_index_shows_it() -> None:
    assumed = world.Assumed()
    victim = pod("a-0", "u1", node="n1", cards=EIGHT)
    assumed.deleting(victim)
    assert assumed.view(index(victim))["ns/a"][0].deleting
    assumed.view(index(dataclasses.replace(victim, deleting=True)))
    assert len(assumed) == 0


def test_a_pod_created_again_under_its_name_is_another_pod() -> None:
    assumed = world.Assumed()
    assumed.reserved(pod("a-0", "u1"), "n1", EIGHT)
    (seen,) = assumed.view(index(pod("a-0", "u1"), pod("b-0", "u2")))["ns/a"]
    assert seen.holds_cards
    (other,) = assumed.view(index(pod("a-0", "u3")))["ns/a"]
    assert not other.holds_cards
    assert len(assumed) == 0


# ---- a whole cycle on a lagging index ------------------------------------------------------


class Executor:
    """Records what the cycle asks of the API; every call succeeds, except Bindings of pods
    already bound to another node (as the API server answers them: 409)."""

    def __init__(self) -> None:
        self.reserved: list[tuple[str, str, str, str]] = []
        self.bound_to: dict[str, str] = {}

    async def reserve(self, items: Sequence[tuple[str, str, str, str]]) -> list[pods.Outcome]:
        self.reserved += items
        return [None] * len(items)

    async def bind(self, items: Sequence[tuple[str, str, str]]) -> list[pods.Outcome]:
        outcomes: list[pods.Outcome] = []
        for namespace, name, node in items:
            where = self.bound_to.setdefault(f"{namespace}/{name}", node)
            outcomes.append(None if where == node else pods.BoundElsewhereError(name))
        return outcomes


async def nothing(*_: Any, **__: Any) -> None:
    return None


def fixed_world(facts: dict[str, list[convert.PodFacts]], jobs: list[Workload]) -> world.World:
    sn = supernode.parse(
        {
            "apiVersion": "matrixpool.dev/v1alpha1",
            "kind": "SuperNode",
            "metadata": {"name": "sn-a"},
            "spec": {
                "nodeSelector": {"matchLabels": {"sn": "a"}},
                "cardResource": CARDS,
                "cardsPerNode": 8,
                "spares": {"nodes": 0},
            },
        }
    )
    nodes = [
        inventory.NodeInfo(inventory.NodeName(f"n{i}"), {"sn": "a"}, True, {CARDS: 8})
        for i in range(4)
    ]
    return world.World({"sn-a": sn}, nodes, {}, facts, jobs)


def job(
    name: str,
    replicas: int,
    *,
    priority: int = 100,
    checkpoint: bool = False,
    status: dict[str, Any] | None = None,
) -> Workload:
    spec: dict[str, Any] = {
        "superNode": "sn-a",
        "replicas": replicas,
        "cardsPerReplica": 8,
        "priority": priority,
    }
    if checkpoint:
        spec["checkpoint"] = {"memory": {"everySteps": 2}}
    body = {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": spec,
    }
    model = trainingjob.parse(body)
    return Workload("TrainingJob", "ns", name, f"uid-{name}", "", 1, model, None, status or {})


def test_a_cycle_on_an_index_that_never_catches_up_gives_no_card_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    executor = Executor()
    monkeypatch.setattr(pods, "reserve", executor.reserve)
    monkeypatch.setattr(pods, "bind", executor.bind)
    monkeypatch.setattr(pods, "create", nothing)
    monkeypatch.setattr(scheduler.k8s_status, "patch_status", nothing)
    monkeypatch.setattr(scheduler, "_event", lambda *_: None)
    first = job("first", 2)
    stale = index(pod("first-0", "p0"), pod("first-1", "p1"))  # what the watch shows, forever
    assumed = world.Assumed()
    memory = scheduler.Memory()
    for _ in range(3):
        seen = fixed_world(assumed.view(stale), [first])
        asyncio.run(scheduler.Cycle(seen, memory, assumed).run())
    assert len(executor.reserved) == 2, "the gang was reserved once, not once per cycle"
    assert set(executor.bound_to) == {"ns/first-0", "ns/first-1"}

    # A second job arrives while the watch still shows the first one unplaced: its pods get
    # the two nodes the first job does not hold.
    second = job("second", 2)
    stale |= index(pod("second-0", "q0"), pod("second-1", "q1"))
    seen = fixed_world(assumed.view(stale), [first, second])
    asyncio.run(scheduler.Cycle(seen, memory, assumed).run())
    held = [(node, cards) for _, _, node, cards in executor.reserved]
    assert len(held) == len(set(held)) == 4, f"a card reserved twice: {held}"


# ---- checkpoint-aware preemption -----------------------------------------------------------


class Calls:
    """The executor's pod calls a cycle made (annotate, delete), with recorders."""

    def __init__(self) -> None:
        self.annotated: list[tuple[str, dict[str, Any]]] = []
        self.deleted: list[str] = []
        self.statuses: list[dict[str, Any]] = []

    async def annotate(self, items: Sequence[tuple[str, str]], values: dict[str, Any]) -> None:
        self.annotated += [(f"{ns}/{name}", dict(values)) for ns, name in items]

    async def delete(self, items: Sequence[tuple[str, str]], grace: int | None = None) -> None:
        self.deleted += [f"{ns}/{name}" for ns, name in items]

    async def patch(self, plural: str, ns: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append({"name": name, **status})


def held(step: int, rank: int, node: str) -> manifest.Holding:
    return manifest.Holding("uid-low", rank, step, "memory", 8, "crc32:0", node, node, 1)


def test_a_preempted_training_job_is_asked_to_checkpoint_and_evicted_on_its_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls, executor = Calls(), Executor()
    for name, fake in (("reserve", executor.reserve), ("bind", executor.bind)):
        monkeypatch.setattr(pods, name, fake)
    monkeypatch.setattr(pods, "create", nothing)
    monkeypatch.setattr(pods, "annotate", calls.annotate)
    monkeypatch.setattr(pods, "delete", calls.delete)
    monkeypatch.setattr(scheduler.k8s_status, "patch_status", calls.patch)
    monkeypatch.setattr(scheduler, "_event", lambda *_: None)
    monkeypatch.setattr(scheduler, "CHECK_SECONDS", 0.0)
    saved = [checkpoints.Inventory((held(4, 0, "n0"), held(4, 1, "n1")))]

    async def inventory(job: str, *_: Any, **__: Any) -> checkpoints.Inventory:
        assert job == "uid-low"
        return saved[0]

    monkeypatch.setattr(checkpoints, "inventory", inventory)
    low = job("low", 2, priority=10, checkpoint=True, status={"checkpoints": {"memory": 4}})
    high = job("high", 4, priority=500)
    facts = index(
        *(pod(f"low-{r}", f"l{r}", node=f"n{r}", cards=EIGHT, phase="Running") for r in range(2)),
        *(pod(f"high-{r}", f"h{r}") for r in range(4)),
    )
    decisions, memory, assumed = world.Decisions(), scheduler.Memory(), world.Assumed()

    async def cycles(count: int) -> None:
        for _ in range(count):
            seen = dataclasses.replace(
                fixed_world(assumed.view(facts), [low, high]), decisions=decisions
            )
            await scheduler.Cycle(seen, memory, assumed).run()
            await asyncio.sleep(0.01)  # the daemons' answer comes in the background

    asyncio.run(cycles(3))
    assert {name for name, _ in calls.annotated} == {"ns/low-0", "ns/low-1"}
    assert "uid-low" in decisions.preempting, "asked, waiting for the answer"
    assert calls.deleted == [], "no pod goes before the answer (step 4 was there before)"
    assert memory.reasons["ns/high"].code == "WaitingForCheckpoint"

    saved[0] = checkpoints.Inventory((held(6, 0, "n0"), held(6, 1, "n1")))  # the answer
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
    resume = checkpoints.parse_restore(decisions.resumes["uid-low"])
    assert resume is not None, "its new pods restore the answered step"
    assert resume.step == 6


def test_training_without_checkpoints_and_inference_give_up_their_cards_at_once() -> None:
    cycle = scheduler.Cycle(fixed_world({}, []), scheduler.Memory())
    assert cycle.checkpoint_grace(job("plain", 2)) is None
    running = fixed_world(index(pod("saver-0", "s0", node="n0", phase="Running")), [])
    saver = job("saver", 1, checkpoint=True)
    assert scheduler.Cycle(running, scheduler.Memory()).checkpoint_grace(saver) == 60.0
