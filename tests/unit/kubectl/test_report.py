"""The plugin's pure reports (matrixpool.kubectl.report) on hand-built API objects."""

from __future__ import annotations

from typing import Any

import pytest

from matrixpool.kubectl import report
from matrixpool.kubectl.report import Owner

CARD = "huawei.com/Ascend910"


def node(name: str, rack: str = "r1", *, ready: bool = True, bad: str = "") -> dict[str, Any]:
    annotations = {"matrixpool.dev/unhealthy-cards": bad} if bad else {}
    return {
        "metadata": {
            "name": name,
            "labels": {
                "matrixpool.dev/supernode": name.split("-node")[0],
                "matrixpool.dev/rack": rack,
            },
            "annotations": annotations,
        },
        "status": {
            "allocatable": {CARD: "8"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod(job: str, kind: str, node_name: str | None, cards: str, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{job}-0",
            "namespace": extra.get("namespace", "ns"),
            "labels": {"matrixpool.dev/job": job, "matrixpool.dev/kind": kind},
            "annotations": {"matrixpool.dev/cards": cards, **extra.get("annotations", {})},
        },
        "spec": {"nodeName": node_name} if node_name else {},
        "status": {"phase": extra.get("phase", "Running")},
    }


def supernode(name: str = "sn", spare_nodes: tuple[str, ...] = (), **cards: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": name}},
            "cardResource": CARD,
            "cardsPerNode": 8,
        },
        "status": {
            "nodes": {"total": 3, "ready": 3},
            "cards": {"total": 24, **cards},
            "spareNodes": list(spare_nodes),
            "window": "day",
            "nextTransition": "2026-12-01T22:00:00+08:00",
        },
    }


NODES = [node("sn-node-0", "r1"), node("sn-node-1", "r1"), node("sn-node-2", "r2")]


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        pytest.param(
            [pod("llm", "TrainingJob", "sn-node-0", "0,1,2,3")],
            {"training": 4, "inference": 0},
            id="a training pod's cards count as training",
        ),
        pytest.param(
            [pod("chat", "InferenceService", "sn-node-1", "0,1,2,3,4,5,6,7")],
            {"training": 0, "inference": 8},
            id="an inference pod's cards count as inference",
        ),
        pytest.param(
            [
                pod(
                    "llm",
                    "TrainingJob",
                    None,
                    "0,1",
                    annotations={"matrixpool.dev/node": "sn-node-0"},
                )
            ],
            {"training": 2, "inference": 0},
            id="a pod being bound counts on its reserved node",
        ),
        pytest.param(
            [pod("llm", "TrainingJob", "sn-node-0", "0,1", phase="Succeeded")],
            {"training": 0, "inference": 0},
            id="a finished pod holds nothing",
        ),
        pytest.param(
            [pod("llm", "TrainingJob", "other-node-0", "0,1")],
            {"training": 0, "inference": 0},
            id="a pod on another supernode's node is not counted",
        ),
        pytest.param(
            [pod("llm", "TrainingJob", None, "")],
            {"training": 0, "inference": 0},
            id="an unbound pod holds nothing",
        ),
    ],
)
def test_status_counts_cards_by_the_kind_of_the_pod_holding_them(
    pods: list[dict[str, Any]], expected: dict[str, int]
) -> None:
    sn = supernode(allocatable=16, allocated=4, spare=8, unhealthy=0)
    [row] = report.status_rows([sn], NODES, pods)
    assert {"training": row.training, "inference": row.inference} == expected


def test_status_takes_spare_unhealthy_free_window_and_nodes_from_the_supernode_status() -> None:
    sn = supernode(allocatable=14, allocated=4, spare=8, unhealthy=2)
    [row] = report.status_rows([sn], NODES, [])
    assert (row.spare, row.unhealthy, row.free) == (8, 2, 10)
    assert (row.nodes_ready, row.nodes_total, row.window) == (3, 3, "day")
    assert row.next_transition.startswith("2026-12-01T22:00:00")


def test_status_rows_are_in_name_order_and_a_fresh_supernode_shows_zeros() -> None:
    fresh = {**supernode("b"), "status": {}}
    rows = report.status_rows([fresh, supernode("a")], NODES, [])
    assert [r.name for r in rows] == ["a", "b"]
    assert (rows[1].free, rows[1].window, rows[1].next_transition) == (0, "", "")


@pytest.mark.parametrize(
    ("the_node", "pods", "spare", "expected"),
    [
        pytest.param(node("sn-node-0"), [], False, "........", id="an idle node is free"),
        pytest.param(node("sn-node-0"), [], True, "SSSSSSSS", id="a spare node is spare"),
        pytest.param(
            node("sn-node-0", bad="3,5"), [], False, "...X.X..", id="marked cards are unhealthy"
        ),
        pytest.param(
            node("sn-node-0", ready=False, bad="3"),
            [],
            False,
            "DDDDDDDD",
            id="every card of a NotReady node is down",
        ),
        pytest.param(
            node("sn-node-0", bad="7"),
            [
                pod("llm", "TrainingJob", "sn-node-0", "0,1,2,3"),
                pod("chat", "InferenceService", "sn-node-0", "4,5"),
            ],
            False,
            "TTTTII.X",
            id="held cards show their owner, unhealthy wins over free",
        ),
    ],
)
def test_card_map_gives_each_card_one_owner(
    the_node: dict[str, Any], pods: list[dict[str, Any]], spare: bool, expected: str
) -> None:
    spares = ("sn-node-0",) if spare else ()
    cards = report.card_map(supernode(spare_nodes=spares), [the_node], pods)
    letters = {Owner.INFERENCE: "I", Owner.TRAINING: "T", Owner.SPARE: "S"}
    letters |= {Owner.UNHEALTHY: "X", Owner.FREE: ".", Owner.DOWN: "D"}
    [rack] = cards.racks
    assert "".join(letters[c] for c in rack.nodes[0].cells) == expected


def test_card_map_groups_member_nodes_by_rack_and_counts_owners() -> None:
    other = node("other-node-0", "r1")
    pods = [pod("llm", "TrainingJob", "sn-node-2", "0,1,2,3,4,5,6,7")]
    cards = report.card_map(supernode(spare_nodes=("sn-node-1",)), [*NODES, other], pods)
    assert [(r.name, [n.name for n in r.nodes]) for r in cards.racks] == [
        ("r1", ["sn-node-0", "sn-node-1"]),
        ("r2", ["sn-node-2"]),
    ]
    assert cards.counts() == {Owner.FREE: 8, Owner.SPARE: 8, Owner.TRAINING: 8}


def training_job(name: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"replicas": 4, "cardsPerReplica": 8},
        "status": status,
    }


def inference_service(name: str, **status: Any) -> dict[str, Any]:
    role = {"name": "decode", "replicas": 2, "podsPerReplica": 2, "cardsPerPod": 8}
    return {
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"roles": [role]},
        "status": status,
    }


def test_jobs_lists_training_from_its_status() -> None:
    job = training_job(
        "llm",
        phase="Running",
        replicas={"desired": 4, "bound": 4, "running": 3},
        placement={"superNode": "sn-0", "superNodes": ["sn-0"], "cards": 32},
    )
    [row] = report.job_rows([job], [], [])
    assert row == report.JobRow("TrainingJob", "ns", "llm", "Running", "sn-0", 32, 4, 4, 3)


def test_jobs_counts_a_services_pods_and_reads_ready_from_its_condition() -> None:
    ready = {"type": "Ready", "status": "True", "reason": "AllReady"}
    ready["lastTransitionTime"] = "2026-12-01T08:00:00Z"
    service = inference_service(
        "chat",
        conditions=[ready],
        roles=[{"name": "decode", "replicas": 1, "ready": 1}],
        placement={"superNode": "sn-0", "cards": 16},
    )
    pods = [
        pod("chat", "InferenceService", "sn-node-0", "0"),
        pod("chat", "InferenceService", None, "", phase="Pending"),
        pod("chat", "InferenceService", "sn-node-1", "0", namespace="elsewhere"),
        pod("chat", "TrainingJob", "sn-node-1", "0"),
    ]
    [row] = report.job_rows([], [service], pods)
    assert row == report.JobRow("InferenceService", "ns", "chat", "Ready", "sn-0", 16, 2, 1, 1)


def test_jobs_shows_the_autoscalers_replicas_and_marks_advice() -> None:
    advice = {"mode": "Advisory", "summary": "prefill 3, decode 1", "time": "2026-12-01T08:00:00Z"}
    [advisory] = report.job_rows([], [inference_service("chat", recommendation=advice)], [])
    applied = {**advice, "mode": "Auto"}
    [auto] = report.job_rows([], [inference_service("chat", recommendation=applied)], [])
    assert advisory.autoscaled == "prefill 3, decode 1 (advice)"
    assert auto.autoscaled == "prefill 3, decode 1"


def test_jobs_shows_a_services_kv_cache_reservation_or_that_it_waits() -> None:
    admitted = {"admitted": True, "reserved": "2Gi", "quotaPerNode": "42Mi", "nodes": 48}
    [held] = report.job_rows([], [inference_service("chat", kvCache=admitted)], [])
    [waits] = report.job_rows([], [inference_service("late", kvCache={"admitted": False})], [])
    [none] = report.job_rows([], [inference_service("plain")], [])
    assert (held.kv, waits.kv, none.kv) == ("2Gi", "waiting", "")


def test_jobs_puts_training_before_inference_and_a_fresh_service_is_not_ready() -> None:
    rows = report.job_rows([training_job("z")], [inference_service("a")], [])
    assert [(r.kind, r.phase, r.desired) for r in rows] == [
        ("TrainingJob", "Pending", 0),
        ("InferenceService", "NotReady", 4),
    ]


def test_recoveries_are_oldest_first_with_their_durations() -> None:
    late = {"level": "Reschedule", "cause": "NodeNotReady", "detectedAt": "2026-12-01T10:00:00Z"}
    early = {
        "level": "InPlace",
        "cause": "PodFailed",
        "restoredStep": 120,
        "lostSteps": 7,
        "detectedAt": "2026-12-01T09:00:00Z",
        "recoveredAt": "2026-12-01T09:00:12.5Z",
    }
    rows = report.recovery_rows(training_job("llm", recoveries=[late, early]))
    assert [(r.level, r.restored_step, r.lost_steps, r.seconds) for r in rows] == [
        ("InPlace", 120, 7, 12.5),
        ("Reschedule", None, None, None),
    ]


def test_recoveries_carry_id_ranks_and_moves_and_end_with_the_one_under_way() -> None:
    done = {
        "id": "r1-a",
        "level": "SpareSwap",
        "cause": "NodeDown on n-1",
        "restoredStep": 40,
        "lostSteps": 2,
        "detectedAt": "2026-12-01T09:00:00Z",
        "recoveredAt": "2026-12-01T09:00:03Z",
        "ranks": [1],
        "moves": {"n-1": "n-9"},
    }
    ongoing = {
        "id": "r2-b",
        "level": "InPlace",
        "cause": "PodFailed on n-2",
        "detectedAt": "2026-12-01T10:00:00Z",
        "ranks": [2],
        "targets": {"2": "n-2"},
    }
    body = training_job("llm", recoveries=[done], recovering=ongoing)
    rows = report.recovery_rows(body)
    assert [(r.id, r.ranks, r.moves, r.recovered_at is None) for r in rows] == [
        ("r1-a", (1,), (("n-1", "n-9"),), False),
        ("r2-b", (2,), (), True),
    ]
    recorded = report.recovery_rows(training_job("llm", recoveries=[done], recovering=done))
    assert [r.id for r in recorded] == ["r1-a"]  # recorded already: not twice


def test_status_shows_the_last_transition() -> None:
    body = supernode()
    body["status"]["transition"] = {
        "window": "night",
        "startedAt": "2026-12-01T14:00:00Z",
        "settledAt": "2026-12-01T14:00:02.7Z",
        "seconds": 2.7,
    }
    [row] = report.status_rows([body], NODES, [])
    assert row.last_transition == "night 2.7s"
    del body["status"]["transition"]["settledAt"]
    [row] = report.status_rows([body], NODES, [])
    assert row.last_transition == "night (under way)"


def test_a_job_without_recoveries_has_an_empty_timeline() -> None:
    assert report.recovery_rows(training_job("llm")) == []


def test_racks_are_in_natural_order() -> None:
    nodes = [node(f"sn-node-{i}", f"rack-{i}") for i in (10, 2, 1)]
    assert [r.name for r in report.card_map(supernode(), nodes, []).racks] == [
        "rack-1",
        "rack-2",
        "rack-10",
    ]
