"""From workload specs to gangs: pod naming, whole-node splitting, inference replicas as gangs,
and the expert map that gives every expert-parallel card exactly one expert."""

from __future__ import annotations

import pytest

from matrixpool.api import inferenceservice, trainingjob
from matrixpool.placement import gangs, model


def training(**spec: object) -> trainingjob.TrainingJobSpec:
    return trainingjob.parse_spec({"replicas": 4, "cardsPerReplica": 8, **spec})


@pytest.mark.parametrize(
    ("per_replica", "node", "expected"),
    [
        pytest.param(8, 8, (1, 8), id="a replica of a whole node is one pod"),
        pytest.param(4, 8, (1, 4), id="a replica smaller than a node is one pod"),
        pytest.param(16, 8, (2, 8), id="a replica of two nodes becomes two whole-node pods"),
        pytest.param(12, 8, (1, 12), id="a replica of 1.5 nodes stays one pod (unservable)"),
        pytest.param(16, None, (1, 16), id="without a known node size nothing is split"),
    ],
)
def test_pods_per_replica(per_replica: int, node: int | None, expected: tuple[int, int]) -> None:
    assert gangs.pods_per_replica(per_replica, node) == expected


def test_a_training_job_is_one_gang_with_stable_pod_names_in_rank_order() -> None:
    gang = gangs.training_gang("ns", "llm", training(minReplicas=2, priority=7), 8)
    assert [p.name for p in gang.pods] == ["llm-0", "llm-1", "llm-2", "llm-3"]
    assert gang.request.gang == "ns/llm"
    assert [r.pod for r in gang.request.pods] == ["ns/llm-0", "ns/llm-1", "ns/llm-2", "ns/llm-3"]
    assert gang.request.priority == 7
    assert gang.request.min_pods == 2
    assert gang.request.affinity is model.Affinity.REQUIRED


def test_split_replicas_scale_group_size_and_elastic_floor_by_pods_per_replica() -> None:
    spec = training(replicas=4, minReplicas=2, cardsPerReplica=16, placement={"groupSize": 2})
    gang = gangs.training_gang("ns", "llm", spec, 8)
    assert len(gang.pods) == 8
    assert {p.cards for p in gang.pods} == {8}
    assert [p.replica for p in gang.pods] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert gang.request.group_size == 4
    assert gang.request.min_pods == 4


def test_a_shrunk_training_job_keeps_its_lowest_ranks() -> None:
    gang = gangs.training_gang("ns", "llm", training(minReplicas=1), 8, replicas=2)
    assert [p.name for p in gang.pods] == ["llm-0", "llm-1"]


def service() -> inferenceservice.InferenceServiceSpec:
    return inferenceservice.parse_spec(
        {
            "superNode": "sn-0",
            "roles": [
                {"name": "prefill", "replicas": 2, "cardsPerPod": 8},
                {
                    "name": "decode",
                    "replicas": 1,
                    "podsPerReplica": 4,
                    "cardsPerPod": 8,
                    "expertParallel": {"experts": 30, "redundantExperts": 2},
                },
            ],
        }
    )


def test_every_inference_replica_is_its_own_gang_spread_by_role() -> None:
    result = gangs.inference_gangs("ns", "ds", service())
    assert [g.request.gang for g in result] == [
        "ns/ds/prefill/0",
        "ns/ds/prefill/1",
        "ns/ds/decode/0",
    ]
    assert [len(g.pods) for g in result] == [1, 1, 4]
    assert {g.request.spread_group for g in result[:2]} == {"ns/ds/prefill"}
    assert result[2].pods[3].name == "ds-decode-0-3"
    assert all(g.request.supernode == "sn-0" for g in result)


def test_role_replica_overrides_scale_one_role() -> None:
    result = gangs.inference_gangs("ns", "ds", service(), {"prefill": 0})
    assert [g.role for g in result] == ["decode"]


def test_the_expert_map_gives_each_card_exactly_one_expert() -> None:
    role = service().roles[1]
    pods = [f"ds-decode-0-{i}" for i in range(4)]
    cards = {pod: tuple(range(8)) for pod in pods}
    mapping = gangs.expert_map(role, cards, pods)
    assert [m["expert"] for m in mapping] == list(range(32))
    assert len({(m["pod"], m["card"]) for m in mapping}) == 32
    assert [m["copyOf"] for m in mapping[30:]] == [0, 1]


def test_the_expert_map_refuses_a_card_count_that_does_not_match() -> None:
    role = service().roles[1]
    with pytest.raises(ValueError, match="32 experts"):
        gangs.expert_map(role, {"p": (0, 1)}, ["p"])
