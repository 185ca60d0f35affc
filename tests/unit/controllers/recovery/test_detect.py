"""The recovery controller's detect step (:mod:`matrixpool.controllers.recovery.detect`): which
faults lie under a bound gang, a stale kubelet Lease among them, and when faults are settled."""

from __future__ import annotations

import datetime as dt

import pytest

from matrixpool import clock
from matrixpool.controllers.recovery import detect, heartbeat
from matrixpool.controllers.recovery import memory as recovery_memory
from matrixpool.k8s import convert
from matrixpool.placement import inventory
from matrixpool.state.workloads import Workload
from matrixpool_recovery import policy

NODES = ("n0", "n1", "n2", "n3")


def pod(
    rank: int, node: str | None = None, phase: str = "Running", **extra: object
) -> convert.PodFacts:
    fields: dict[str, object] = {
        "namespace": "ns",
        "name": f"llm-{rank}",
        "owner": "llm",
        "kind": "TrainingJob",
        "role": "trainer",
        "replica": 0,
        "rank": rank,
        "node": node if node is not None else NODES[rank],
        "reserved_node": None,
        "cards": frozenset(range(8)),
        "phase": phase,
        "deleting": False,
        "ready": phase == "Running",
    }
    fields.update(extra)
    return convert.PodFacts(**fields)  # type: ignore[arg-type]


def node(
    name: str, *, down: bool = False, unhealthy: frozenset[int] = frozenset()
) -> inventory.NodeInfo:
    return inventory.NodeInfo(
        inventory.NodeName(name), {}, not down, {"c": 8}, unhealthy, f"{name}:7040", down
    )


def healthy() -> dict[str, inventory.NodeInfo]:
    return {n: node(n) for n in NODES}


def gang() -> list[convert.PodFacts]:
    return [pod(r) for r in range(4)]


def kinds(faults: list[policy.Fault]) -> list[tuple[str, str, list[int], list[int]]]:
    return [(f.kind.value, f.node, sorted(f.ranks), sorted(f.cards)) for f in faults]


@pytest.mark.parametrize(
    ("sentence", "nodes", "pods", "silent", "expected"),
    [
        ("a healthy gang has no fault", healthy(), gang(), (), []),
        (
            "a rank's node NotReady is NodeDown",
            {**healthy(), "n1": node("n1", down=True)},
            gang(),
            (),
            [("NodeDown", "n1", [], [])],
        ),
        (
            "a rank's node gone is NodeDeleted",
            {n: i for n, i in healthy().items() if n != "n2"},
            gang(),
            (),
            [("NodeDeleted", "n2", [], [])],
        ),
        (
            "a silent daemon under a rank is DaemonUnreachable",
            healthy(),
            gang(),
            ("n3",),
            [("DaemonUnreachable", "n3", [], [])],
        ),
        (
            "an unhealthy card the rank holds is CardsUnhealthy, naming the card",
            {**healthy(), "n0": node("n0", unhealthy=frozenset({3, 9}))},
            gang(),
            (),
            [("CardsUnhealthy", "n0", [], [3])],
        ),
        (
            "an unhealthy card nobody holds is no fault",
            {**healthy(), "n0": node("n0", unhealthy=frozenset({3}))},
            [pod(0, cards=frozenset({4, 5})), *gang()[1:]],
            (),
            [],
        ),
        (
            "a failed pod on a healthy node is PodFailed, naming its rank",
            healthy(),
            [*gang()[:2], pod(2, phase="Failed"), pod(3)],
            (),
            [("PodFailed", "n2", [2], [])],
        ),
        (
            "a node down outranks its silent daemon and its failed pods (one fault per node)",
            {**healthy(), "n1": node("n1", down=True)},
            [pod(0), pod(1, phase="Failed"), pod(2), pod(3)],
            ("n1",),
            [("NodeDown", "n1", [], [])],
        ),
        (
            "a gang not wholly bound is still being placed: no fault",
            {**healthy(), "n1": node("n1", down=True)},
            [*gang()[:3], pod(3, node="")],
            (),
            [],
        ),
        (
            "a pod being deleted does not count as bound",
            healthy(),
            [*gang()[:3], pod(3, phase="Failed", deleting=True)],
            (),
            [],
        ),
    ],
)
def test_detect(
    sentence: str,
    nodes: dict[str, inventory.NodeInfo],
    pods: list[convert.PodFacts],
    silent: tuple[str, ...],
    expected: list[tuple[str, str, list[int], list[int]]],
) -> None:
    assert kinds(detect.detect(4, pods, nodes, silent)) == expected, sentence


def test_node_losses_wait_to_settle_but_a_failed_pod_is_decided_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(clock.SYSTEM, "monotonic", lambda: now[0])
    state = recovery_memory.State()
    a, b = (Workload("TrainingJob", "ns", n, f"uid-{n}", "", 1, None, None, {}) for n in "ab")
    down = [policy.Fault(policy.FaultKind.NODE_DOWN, policy.NodeName("n1"))]
    failed = [
        policy.Fault(policy.FaultKind.POD_FAILED, policy.NodeName("n2"), ranks=frozenset({2}))
    ]
    assert detect.settled(a, failed, state)
    assert not detect.settled(b, down, state)
    now[0] += detect.SETTLE_SECONDS / 2
    assert not detect.settled(b, down, state)
    now[0] += detect.SETTLE_SECONDS / 2
    assert detect.settled(b, down, state)


def test_a_fault_is_dated_from_when_the_node_watch_showed_it_not_from_the_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pass that gets to a fault may come seconds after the Node event (64 supernodes):
    detection and the settle window count from the event's stamp (controllers.wake)."""
    now = [100.0]
    monkeypatch.setattr(clock.SYSTEM, "monotonic", lambda: now[0])
    state = recovery_memory.State()
    job = Workload("TrainingJob", "ns", "a", "uid-a", "", 1, None, None, {})
    shown = dt.datetime(2026, 12, 5, 11, 0, 0, tzinfo=dt.UTC)
    noticed = {
        ("n1", "down"): (99.0, shown),
        ("n2", "card:3"): (99.5, shown + dt.timedelta(seconds=0.5)),
        ("n9", "down"): (10.0, shown - dt.timedelta(seconds=89)),  # no rank there
    }
    down = [policy.Fault(policy.FaultKind.NODE_DOWN, policy.NodeName("n1"))]
    assert detect.settled(job, down, state, noticed)  # shown 1 s ago: settled already
    assert state.first_seen["uid-a"] == (99.0, shown)
    state.first_seen.clear()
    cards = [policy.Fault(policy.FaultKind.CARDS_UNHEALTHY, "n2", frozenset({3}))]
    assert detect.settled(job, cards, state, noticed)
    assert state.first_seen["uid-a"][1] == shown + dt.timedelta(seconds=0.5)
    state.first_seen.clear()
    other = [policy.Fault(policy.FaultKind.CARDS_UNHEALTHY, "n2", frozenset({4}))]
    assert detect.settled(job, other, state, noticed)  # card 4 was never stamped: now
    assert state.first_seen["uid-a"][0] == 100.0
    state.first_seen.clear()
    now[0] = 99.2  # a stamp can only be earlier than the pass: never later than now
    assert not detect.settled(job, [*down, *cards], state, noticed)  # 0.2 s: settling
    assert state.first_seen["uid-a"][0] == 99.0


def test_a_lease_overdue_by_three_quarters_of_its_duration_counts_as_a_node_down() -> None:
    fresh = {f"ok-{i}": (95.0, 40.0) for i in range(10)}
    leases = {**fresh, "n1": (65.0, 40.0), "n2": (90.0, 10.0), "n3": (75.0, 40.0)}
    assert heartbeat.stale_leases(leases, now=100.0) == {"n1", "n2"}  # 35 > 30, 10 > 7.5; 25 < 30
    faults = detect.detect(4, gang(), healthy(), (), stale={"n1"})
    assert kinds(faults) == [("NodeDown", "n1", [], [])]
