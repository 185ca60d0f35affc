"""The recovery controller's pure parts: which faults lie under a bound gang, how daemon
holdings become the policy's copies, when faults are settled, and how a recovering job's new
pods are pinned (handlers.recovery, handlers.scheduler.pin)."""

from __future__ import annotations

import asyncio

import pytest

from matrixpool import clock
from matrixpool.controllers import recovery
from matrixpool.controllers.scheduling import cycle as scheduler
from matrixpool.k8s import convert
from matrixpool.placement import inventory
from matrixpool.state import decisions as decided
from matrixpool.state import indexes
from matrixpool.state.workloads import Workload
from matrixpool_recovery import manifest, policy
from matrixpool_recovery import restore as restore_codec

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
    assert kinds(recovery.detect(4, pods, nodes, silent)) == expected, sentence


def test_holdings_become_copies_by_who_holds_them() -> None:
    view = policy.JobView(
        key="ns/llm",
        world_size=2,
        node_of={0: policy.NodeName("n0"), 1: policy.NodeName("n1")},
        cards_of={0: frozenset(), 1: frozenset()},
        rack_of={},
        supernode_of={},
    )
    held = [
        manifest.Holding("ns.llm", 0, 4, "memory", 1, "c", "n0", "n0"),  # its own node
        manifest.Holding("ns.llm", 1, 4, "memory", 1, "c", "n0", "n1"),  # a peer's copy
        manifest.Holding("ns.llm", 1, 5, "local", 1, "c", "n1", "n1"),
        manifest.Holding("ns.llm", 0, 3, "persistent", 1, "c", "", "n0"),
    ]
    copies = list(recovery.copies_of(held, view))
    assert [(c.rank, c.step, c.tier, c.node) for c in copies] == [
        (0, 4, policy.Tier.MEMORY, "n0"),
        (1, 4, policy.Tier.PEERS, "n0"),
        (1, 5, policy.Tier.LOCAL, "n1"),
        (0, 3, policy.Tier.PERSISTENT, None),
    ]


def test_node_losses_wait_to_settle_but_a_failed_pod_is_decided_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(clock.SYSTEM, "monotonic", lambda: now[0])
    state = recovery.State()
    a, b = (Workload("TrainingJob", "ns", n, f"uid-{n}", "", 1, None, None, {}) for n in "ab")
    down = [policy.Fault(policy.FaultKind.NODE_DOWN, policy.NodeName("n1"))]
    failed = [
        policy.Fault(policy.FaultKind.POD_FAILED, policy.NodeName("n2"), ranks=frozenset({2}))
    ]
    assert recovery.settled(a, failed, state)
    assert not recovery.settled(b, down, state)
    now[0] += recovery.SETTLE_SECONDS / 2
    assert not recovery.settled(b, down, state)
    now[0] += recovery.SETTLE_SECONDS / 2
    assert recovery.settled(b, down, state)


def test_a_recovering_jobs_new_pod_is_reserved_on_its_target_and_told_what_to_restore() -> None:
    plan = decided.RecoveryPlan.read(
        {
            "level": "SpareSwap",
            "cause": "NodeNotReady on n1",
            "detectedAt": "2026-12-03T12:00:00Z",
            "targets": {"1": "spare-0"},
            "cards": {"1": "0,1,2,3"},
            "restore": {"0": '{"step":8}', "1": '{"from":["a:7040"],"step":8}'},
        }
    )
    moved = scheduler.pin({"metadata": {"labels": {"matrixpool.dev/rank": "1"}}}, plan)
    assert moved["metadata"]["annotations"] == {
        "matrixpool.dev/restore": '{"from":["a:7040"],"step":8}',
        "matrixpool.dev/node": "spare-0",
        "matrixpool.dev/cards": "0,1,2,3",
    }
    stayed = scheduler.pin({"metadata": {"labels": {"matrixpool.dev/rank": "0"}}}, plan)
    assert stayed["metadata"]["annotations"] == {"matrixpool.dev/restore": '{"step":8}'}
    untouched = scheduler.pin({"metadata": {"labels": {"matrixpool.dev/rank": "0"}}}, None)
    assert "annotations" not in untouched["metadata"]


@pytest.mark.parametrize(
    ("value", "step", "sources", "recovery_id"),
    [
        ("latest", None, (), ""),
        ("12", 12, (), ""),
        ('{"step": 8, "from": ["a:1", "b:2"], "recovery": "r1"}', 8, ("a:1", "b:2"), "r1"),
        ('{"from": []}', None, (), ""),
    ],
)
def test_the_restore_annotation_reads_back(
    value: str, step: int | None, sources: tuple[str, ...], recovery_id: str
) -> None:
    assert restore_codec.parse_restore(value) == restore_codec.Restore(step, sources, recovery_id)


def test_the_restore_annotation_round_trips_and_rejects_nonsense() -> None:
    written = restore_codec.restore_value(8, ["b:2", "a:1", "a:1"], "r3")
    assert written == '{"from":["a:1","b:2"],"recovery":"r3","step":8}'
    assert restore_codec.parse_restore(written) == restore_codec.Restore(8, ("a:1", "b:2"), "r3")
    assert restore_codec.parse_restore("") is None
    for bad in ("{", "[1]", '{"step": -1}', '{"from": "a:1"}'):
        with pytest.raises(ValueError, match=r"JSON|step|from"):
            restore_codec.parse_restore(bad)


def test_a_lease_overdue_by_three_quarters_of_its_duration_counts_as_a_node_down() -> None:
    fresh = {f"ok-{i}": (95.0, 40.0) for i in range(10)}
    leases = {**fresh, "n1": (65.0, 40.0), "n2": (90.0, 10.0), "n3": (75.0, 40.0)}
    assert recovery.stale_leases(leases, now=100.0) == {"n1", "n2"}  # 35 > 30, 10 > 7.5; 25 < 30
    faults = recovery.detect(4, gang(), healthy(), (), stale={"n1"})
    assert kinds(faults) == [("NodeDown", "n1", [], [])]


def test_many_overdue_leases_at_once_mean_the_api_server_not_the_nodes() -> None:
    leases = {f"n{i}": (50.0 if i < 3 else 95.0, 40.0) for i in range(12)}  # a quarter overdue
    assert recovery.stale_leases(leases, now=100.0) == frozenset()


def test_lease_age_is_measured_from_when_its_renew_time_last_changed_on_the_operators_clock() -> (
    None
):
    leases = recovery.LeaseClock()
    fleet = {f"ok-{i}": (float(i), 40.0) for i in range(10)}
    skewed = {**fleet, "n1": (-3600.0, 40.0)}  # the kubelet's clock is an hour behind
    assert leases.observe(skewed, now=1000.0) == frozenset(), "a fresh start gives full grace"
    assert leases.observe({**fleet, "n1": (-3590.0, 40.0)}, now=1010.0) == frozenset()
    assert leases.observe({**fleet, "n1": (-3580.0, 40.0)}, now=1039.0) == frozenset()
    renewed_fleet = {n: (r + 60.0, d) for n, (r, d) in fleet.items()}
    silent = {**renewed_fleet, "n1": (-3580.0, 40.0)}  # n1 stops renewing at 1039
    assert leases.observe(silent, now=1068.0) == frozenset()  # 29 s < 30 s
    assert leases.observe(silent, now=1070.0) == {"n1"}  # 31 s without a change
    assert leases.observe({**renewed_fleet, "n1": (-3570.0, 40.0)}, now=1071.0) == frozenset()
    leases.observe(renewed_fleet, now=1072.0)
    assert "n1" not in leases.seen, "a node whose Lease went is forgotten"


def test_a_lease_index_entry_reads_renew_time_and_duration() -> None:
    spec = {"renewTime": "2026-11-30T05:00:00.000000Z", "leaseDurationSeconds": 40}
    [(name, (renewed, duration))] = asyncio.run(indexes.node_leases(name="n3", spec=spec)).items()
    assert (name, duration) == ("n3", 40.0)
    assert renewed == 1796014800.0
    assert asyncio.run(indexes.node_leases(name="n4", spec={})) == {}
