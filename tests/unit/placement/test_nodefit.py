"""Placement respects the pod (issue 13): what a pod asks of a node besides cards — resources
against the room its node has left, taints, nodeSelector, required node affinity, cordon — and
the reasons a gang gives when these keep it out. Quantities and pod specs are read as
kube-scheduler reads them."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from kubernetes.utils import parse_quantity

from matrixpool.placement import diagnose, engine, model, nodefit, quantities
from matrixpool.placement.inventory import NodeName
from tests.builders import gang, holding, supernode

A4 = supernode("sn-a").racks(1, nodes=4).room(cpu="16", memory="64Gi")  # 4 nodes × 8 cards


def nodes_of(verdict: model.Placement | model.Unplaceable) -> list[str]:
    assert isinstance(verdict, model.Placement), verdict
    return [a.node for a in verdict.assignments]


def reason_of(verdict: model.Placement | model.Unplaceable) -> model.Reason:
    assert isinstance(verdict, model.Unplaceable), verdict
    return verdict.reasons[0]


def place(
    topology: model.SuperNodeTopology,
    request: model.GangRequest,
    holdings: list[model.Holding] | None = None,
) -> model.Placement | model.Unplaceable:
    return engine.place(engine.Snapshot.build([topology], holdings or []), request)


# ---- quantities ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resource", "text", "amount"),
    [
        pytest.param("cpu", "500m", 500, id="millicores stay millicores"),
        pytest.param("cpu", "2", 2000, id="whole cores become millicores"),
        pytest.param("cpu", "0.1", 100, id="a decimal core"),
        pytest.param("cpu", "1e3", 1_000_000, id="an exponent"),
        pytest.param("cpu", "100u", 1, id="less than a millicore rounds up"),
        pytest.param("memory", "2Gi", 2 * 1024**3, id="binary suffix"),
        pytest.param("memory", "129M", 129_000_000, id="decimal suffix"),
        pytest.param("memory", "1.5Ki", 1536, id="a fraction of a binary unit"),
        pytest.param("memory", "5m", 1, id="a milli-byte rounds up to a byte"),
        pytest.param("memory", "1E", 10**18, id="E alone is exa, not an exponent"),
        pytest.param("huawei.com/Ascend910", "8", 8, id="an extended resource counts units"),
    ],
)
def test_quantities_are_read_as_kube_scheduler_reads_them(
    resource: str, text: str, amount: int
) -> None:
    assert quantities.amount(resource, text) == amount


@pytest.mark.parametrize("text", ["500m", "2Gi", "1e3", "1.5Ki", "129M", "12E", "0.25", "7Ti"])
def test_the_pure_parser_agrees_with_the_kubernetes_client(text: str) -> None:
    assert quantities.parse(text) == Fraction(Decimal(parse_quantity(text)))  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("text", ["", "abc", "1Gb", "--1", "1e"])
def test_a_malformed_quantity_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantities.parse(text)


# ---- pod specs -------------------------------------------------------------------------------


def container(**resources: dict[str, str]) -> dict[str, Any]:
    return {"name": "c", "image": "i", "resources": resources}


def test_a_pods_request_sums_its_containers_and_takes_limits_when_requests_are_absent() -> None:
    spec = {
        "containers": [
            container(requests={"cpu": "1", "memory": "1Gi"}),
            container(limits={"cpu": "500m", "memory": "2Gi"}, requests={"memory": "1Gi"}),
        ]
    }
    assert nodefit.pod_requests(spec) == {"cpu": 1500, "memory": 2 * 1024**3}


def test_init_containers_count_by_the_largest_and_sidecars_add_up() -> None:
    spec = {
        "containers": [container(requests={"cpu": "1"})],
        "initContainers": [
            {**container(requests={"cpu": "3"})},  # runs alone before the others
            {**container(requests={"cpu": "500m"}), "restartPolicy": "Always"},  # a sidecar
        ],
        "overhead": {"cpu": "100m"},
    }
    assert nodefit.pod_requests(spec) == {"cpu": 3100}, "max(1 + 0.5 sidecar, 3) + overhead"


def test_a_templates_needs_leave_out_the_card_resource() -> None:
    template = {
        "spec": {
            "containers": [container(requests={"cpu": "4", "huawei.com/Ascend910": "8"})],
            "nodeSelector": {"zone": "a"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "gen", "operator": "Gt", "values": ["2"]}
                                ]
                            }
                        ]
                    }
                }
            },
        }
    }
    needs = nodefit.needs_of(template, "huawei.com/Ascend910")
    assert needs.requests == (("cpu", 4000),)
    assert needs.node_selector == (("zone", "a"),)
    assert needs.tolerations == (nodefit.Toleration("dedicated", "Exists"),)
    assert needs.affinity == (nodefit.Term((nodefit.Requirement("gen", "Gt", ("2",)),)),)
    assert nodefit.needs_of({}) == nodefit.NO_NEEDS


@pytest.mark.parametrize(
    ("toleration", "taint", "tolerated"),
    [
        (nodefit.Toleration("k", "Equal", "v"), nodefit.Taint("k", "v"), True),
        (nodefit.Toleration("k", "Equal", "w"), nodefit.Taint("k", "v"), False),
        (nodefit.Toleration("k", "Exists"), nodefit.Taint("k", "v"), True),
        (nodefit.Toleration("", "Exists"), nodefit.Taint("any", "v", "NoExecute"), True),
        (nodefit.Toleration("k", "Exists", effect="NoExecute"), nodefit.Taint("k", "v"), False),
    ],
    ids=[
        "equal value",
        "another value",
        "exists",
        "an empty key with Exists tolerates every taint",
        "another effect",
    ],
)
def test_tolerations_match_taints_as_kubernetes_does(
    toleration: nodefit.Toleration, taint: nodefit.Taint, tolerated: bool
) -> None:
    assert toleration.tolerates(taint) is tolerated


@pytest.mark.parametrize(
    ("requirement", "labels", "matches"),
    [
        (nodefit.Requirement("gen", "Gt", ("2",)), {"gen": "3"}, True),
        (nodefit.Requirement("gen", "Gt", ("2",)), {"gen": "2"}, False),
        (nodefit.Requirement("gen", "Lt", ("2",)), {"gen": "1"}, True),
        (nodefit.Requirement("gen", "Lt", ("2",)), {"gen": "x"}, False),
        (nodefit.Requirement("gen", "Gt", ("2",)), {}, False),
        (nodefit.Requirement("zone", "NotIn", ("a",)), {}, True),
        (nodefit.Requirement("zone", "In", ("a", "b")), {"zone": "b"}, True),
        (nodefit.Requirement("zone", "DoesNotExist"), {"zone": "b"}, False),
    ],
)
def test_node_affinity_operators(
    requirement: nodefit.Requirement, labels: dict[str, str], matches: bool
) -> None:
    assert requirement.matches(labels) is matches


def test_an_empty_term_matches_no_node_and_fields_match_the_node_name() -> None:
    assert not nodefit.Term().matches("n1", {})
    by_name = nodefit.Term(fields=(nodefit.Requirement("metadata.name", "In", ("n1",)),))
    assert by_name.matches("n1", {})
    assert not by_name.matches("n2", {})


# ---- the engine ------------------------------------------------------------------------------


def test_pods_go_only_where_their_cpu_fits_and_a_node_takes_as_many_as_its_room_holds() -> None:
    request = gang("ns/j").pods(4, cards=2).asks(cpu="7").build()  # 2 per node of 16 cpu
    nodes = nodes_of(place(A4.build(), request))
    assert sorted(nodes) == ["sn-a-node-00", "sn-a-node-00", "sn-a-node-01", "sn-a-node-01"]


def test_the_requests_of_pods_already_held_count_against_the_room() -> None:
    busy = holding("ns/old").on("sn-a-node-00", [0]).priority(1).asking(cpu="10").build()
    request = gang("ns/j").pods(1, cards=2).asks(cpu="8").build()
    verdict = place(A4.build(), request, [busy])
    assert nodes_of(verdict) == ["sn-a-node-01"], "node 00 has 6 cpu left, node 01 has 16"


def test_a_commit_records_the_requests_for_the_next_gang_of_the_cycle() -> None:
    snapshot = engine.Snapshot.build([A4.build()], [])
    first = engine.place(snapshot, gang("ns/a").pods(1, cards=1).asks(cpu="12").build())
    assert isinstance(first, model.Placement)
    snapshot.commit(first)
    second = engine.place(snapshot, gang("ns/b").pods(1, cards=1).asks(cpu="12").build())
    assert nodes_of(second) != nodes_of(first), "12 + 12 cpu do not fit one node of 16"


def test_placing_leaves_the_used_room_as_it_was() -> None:
    busy = holding("ns/old").on("sn-a-node-00", [0]).asking(cpu="10").build()
    snapshot = engine.Snapshot.build([A4.build()], [busy])
    before, free = dict(snapshot.used), list(snapshot.free)
    engine.place(snapshot, gang("ns/j").pods(3, cards=2).asks(cpu="9").build())
    engine.place(snapshot, gang("ns/k").pods(9, cards=8).asks(cpu="1").build())  # does not fit
    assert snapshot.used == before
    assert snapshot.free == free


def test_a_gang_short_of_cpu_everywhere_says_insufficient_cpu() -> None:
    verdict = place(A4.build(), gang("ns/j").pods(1, cards=8).asks(cpu="17").build())
    reason = reason_of(verdict)
    assert reason.code == diagnose.INSUFFICIENT_RESOURCES
    assert "0/4 nodes can take a pod: 4 node(s) with insufficient cpu" in reason.message
    assert "cpu 17 each" in reason.message


def test_memory_counts_like_cpu() -> None:
    topology = A4.where(0, lambda n: n.room(cpu="16", memory="8Gi")).build()
    request = gang("ns/j").pods(4, cards=8).asks(memory="16Gi").build()
    reason = reason_of(place(topology, request))
    assert reason.code == diagnose.INSUFFICIENT_RESOURCES
    assert "3/4 nodes can take a pod: 1 node(s) with insufficient memory" in reason.message


def test_a_resource_the_node_does_not_list_is_none_at_all() -> None:
    request = gang("ns/j").pods(1, cards=1).asks(**{"example.com/fpga": "1"}).build()
    assert "insufficient example.com/fpga" in reason_of(place(A4.build(), request)).message


def test_a_tainted_node_is_avoided_unless_tolerated() -> None:
    topology = A4.where(0, lambda n: n.taint("dedicated", "infer")).build()
    assert "sn-a-node-00" not in nodes_of(place(topology, gang("ns/j").pods(3, cards=8).build()))
    tolerant = gang("ns/j").pods(4, cards=8).tolerates("dedicated", "infer").build()
    assert "sn-a-node-00" in nodes_of(place(topology, tolerant))
    reason = reason_of(place(topology, gang("ns/j").pods(4, cards=8).build()))
    assert reason.code == diagnose.UNTOLERATED_TAINT
    assert "1 node(s) had untolerated taint dedicated=infer:NoSchedule" in reason.message


def test_a_prefer_no_schedule_taint_keeps_no_pod_out() -> None:
    topology = A4.where(0, lambda n: n.taint("soft", effect="PreferNoSchedule")).build()
    assert len(nodes_of(place(topology, gang("ns/j").pods(4, cards=8).build()))) == 4


def test_a_node_selector_restricts_the_nodes() -> None:
    topology = A4.where(2, lambda n: n.label("zone", "a")).build()
    assert nodes_of(place(topology, gang("ns/j").pods(1, cards=2).selects(zone="a").build())) == [
        "sn-a-node-02"
    ]
    reason = reason_of(place(topology, gang("ns/j").pods(2, cards=8).selects(zone="a").build()))
    assert reason.code == diagnose.NODE_SELECTOR_MISMATCH
    assert "3 node(s) didn't match nodeSelector" in reason.message


def test_required_node_affinity_restricts_the_nodes() -> None:
    topology = A4.where(1, lambda n: n.label("gen", "3")).where(2, lambda n: n.label("gen", "1"))
    newer = nodefit.Term((nodefit.Requirement("gen", "Gt", ("2",)),))
    request = gang("ns/j").pods(1, cards=8).requires(newer).build()
    assert nodes_of(place(topology.build(), request)) == ["sn-a-node-01"]
    two = gang("ns/j").pods(2, cards=8).requires(newer).build()
    assert reason_of(place(topology.build(), two)).code == diagnose.NODE_AFFINITY_MISMATCH


def test_a_cordoned_node_gets_no_new_pod_and_is_named_in_the_reason() -> None:
    topology = A4.where(3, lambda n: n.cordoned()).build()
    assert "sn-a-node-03" not in nodes_of(place(topology, gang("ns/j").pods(3, cards=8).build()))
    reason = reason_of(place(topology, gang("ns/j").pods(4, cards=8).build()))
    assert reason.code == diagnose.NODES_CORDONED
    assert "3/4 nodes can take a pod: 1 node(s) cordoned" in reason.message


def test_a_gang_waiting_for_cards_keeps_its_cards_reason_with_the_breakdown() -> None:
    topology = A4.where(3, lambda n: n.cordoned()).build()
    full = [
        holding(f"ns/old-{k}").on(f"sn-a-node-0{k}", range(8)).priority(1).build() for k in range(2)
    ]
    reason = reason_of(place(topology, gang("ns/j").pods(2, cards=8).build(), full))
    assert reason.code == engine.INSUFFICIENT_CARDS
    assert "2 node(s) without enough free cards, 1 node(s) cordoned" in reason.message


def test_a_gang_asking_nothing_of_untainted_nodes_keeps_the_old_reasons() -> None:
    reason = reason_of(place(A4.build(), gang("ns/j").pods(5, cards=8).build()))
    assert reason.code == engine.INSUFFICIENT_CARDS
    assert "nodes can take a pod" not in reason.message


def test_preemption_frees_the_room_of_its_victims() -> None:
    victims = [
        holding(f"ns/low-{k}").on(f"sn-a-node-0{k}", [0]).priority(1).asking(cpu="12").build()
        for k in range(4)
    ]
    snapshot = engine.Snapshot.build([A4.build()], victims)
    request = gang("ns/hi").pods(1, cards=2).asks(cpu="8").priority(10).build()
    assert reason_of(engine.place(snapshot, request)).code == diagnose.INSUFFICIENT_RESOURCES
    requests = {
        model.GangKey(f"ns/low-{k}"): gang(f"ns/low-{k}").pods(1, cards=1).priority(1).build()
        for k in range(4)
    }
    plan = engine.preempt(snapshot, request, requests)
    assert isinstance(plan, model.Preemption), plan
    assert len(plan.evict) == 1
    assert not plan.shrink


def test_the_static_filters_run_once_per_distinct_needs() -> None:
    snapshot = engine.Snapshot.build([A4.where(0, lambda n: n.taint("t")).build()], [])
    request = gang("ns/j").pods(1, cards=8).asks(cpu="1").build()
    engine.place(snapshot, request)
    fit = snapshot.layout.fit(request.needs)
    engine.place(snapshot, gang("ns/k").pods(2, cards=8).asks(cpu="1").build())
    assert snapshot.layout.fit(request.needs) is fit
    assert fit.blocked == (snapshot.layout.index[NodeName("sn-a-node-00")],)


def test_on_a_tie_the_reason_is_the_earlier_filter_as_kube_scheduler_orders_them() -> None:
    topology = (
        A4.where(0, lambda n: n.taint("dedicated", "infer"))
        .where(1, lambda n: n.cordoned())
        .where(2, lambda n: n.room(cpu="1"))
        .build()
    )
    reason = reason_of(place(topology, gang("ns/j").pods(2, cards=8).asks(cpu="2").build()))
    assert reason.code == diagnose.NODES_CORDONED
    assert "1/4 nodes can take a pod" in reason.message
