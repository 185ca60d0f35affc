"""The placement rules of DESIGN.md's scheduling contract, one table row per rule."""

from __future__ import annotations

import pytest

from matrixpool.placement import engine, inventory, model
from tests.builders import cloudmatrix, gang, holding, node, supernode

A4 = supernode("sn-a").racks(1, nodes=4)  # one rack of 4 nodes × 8 cards, no card groups
RINGS = ((0, 1, 2, 3), (4, 5, 6, 7))
Expected = list[tuple[str, tuple[int, ...]]] | str  # (node, cards) per rank, or a reason code


def held(node_name: str, *cards: int) -> model.Holding:
    """A one-pod gang of priority 1 holding ``cards`` of ``node_name``."""
    return holding(f"ns/old-{node_name}").on(node_name, cards).priority(1).build()


def verdict_of(
    topologies: list[model.SuperNodeTopology],
    holdings: list[model.Holding],
    request: model.GangRequest,
) -> model.Placement | model.Unplaceable:
    return engine.place(engine.Snapshot.build(topologies, holdings), request)


def as_expected(verdict: model.Placement | model.Unplaceable) -> Expected:
    if isinstance(verdict, model.Unplaceable):
        return verdict.reasons[0].code
    return [(a.node, tuple(a.cards)) for a in verdict.assignments]


ALL8 = tuple(model.CardId(c) for c in range(8))


@pytest.mark.parametrize(
    ("topologies", "holdings", "request_", "expected"),
    [
        pytest.param(
            [A4.build()],
            [held("sn-a-node-00", 0)],
            gang("ns/j").pods(1, cards=8).build(),
            [("sn-a-node-01", ALL8)],
            id="a pod as big as a node takes an empty node",
        ),
        pytest.param(
            [A4.build()],
            [held("sn-a-node-02", 0, 1, 2, 3)],
            gang("ns/j").pods(1, cards=2).build(),
            [("sn-a-node-02", (4, 5))],
            id="a small pod fills a partially used node before breaking an empty one",
        ),
        pytest.param(
            [A4.build()],
            [held("sn-a-node-00", 0, 1), held("sn-a-node-01", 0, 1, 2, 3, 4, 5)],
            gang("ns/j").pods(1, cards=2).build(),
            [("sn-a-node-01", (6, 7))],
            id="best fit: the partially used node with the fewest free cards",
        ),
        pytest.param(
            [A4.groups(*RINGS).build()],
            [held("sn-a-node-00", 0)],
            gang("ns/j").pods(1, cards=4).build(),
            [("sn-a-node-00", (4, 5, 6, 7))],
            id="a request of 4 cards stays inside one card group",
        ),
        pytest.param(
            [A4.groups(*RINGS).build()],
            [held("sn-a-node-00", 0)],
            gang("ns/j").pods(1, cards=2).build(),
            [("sn-a-node-00", (1, 2))],
            id="a small request takes the card group with the fewest free cards",
        ),
        pytest.param(
            [A4.groups([0, 1], [2, 3], [4, 5], [6, 7]).build()],
            [held("sn-a-node-00", 0)],
            gang("ns/j").pods(1, cards=4).build(),
            [("sn-a-node-00", (2, 3, 4, 5))],
            id="a request bigger than a card group takes whole groups",
        ),
        pytest.param(
            [supernode("sn-a").racks(1, nodes=1).unhealthy(0, 0, 1).build()],
            [],
            gang("ns/j").pods(1, cards=6).build(),
            [("sn-a-node-00", (2, 3, 4, 5, 6, 7))],
            id="unhealthy cards are never used",
        ),
        pytest.param(
            [supernode("sn-a").racks(1, nodes=1).unhealthy(0, 7).build()],
            [],
            gang("ns/j").pods(1, cards=8).build(),
            "InsufficientCards",
            id="a node with an unhealthy card holds no whole-node pod",
        ),
        pytest.param(
            [supernode("sn-a").racks(1, nodes=4).not_ready(0, 1, 2).build()],
            [],
            gang("ns/j").pods(1, cards=8).build(),
            [("sn-a-node-03", ALL8)],
            id="NotReady nodes are never used",
        ),
        pytest.param(
            [A4.spares(1).build()],
            [],
            gang("ns/j").pods(4, cards=8).build(),
            "InsufficientCards",
            id="spare nodes are never used for normal placement",
        ),
        pytest.param(
            [A4.spares(1).build()],
            [held("sn-a-node-03", 0)],
            gang("ns/j").pods(2, cards=8).build(),
            [("sn-a-node-00", ALL8), ("sn-a-node-01", ALL8)],
            id="the spare is the last idle healthy node in name order",
        ),
        pytest.param(
            [supernode("sn-a").racks(1, nodes=4).build(), supernode("sn-b").build()],
            [held("sn-a-node-00", 0)],
            gang("ns/j").pods(1, cards=8).on("sn-b").build(),
            [("sn-b-node-00", ALL8)],
            id="Required with a named supernode goes there",
        ),
        pytest.param(
            [supernode("sn-a").racks(1, nodes=4).build(), supernode("sn-b").build()],
            [held("sn-a-node-00", 0)],
            gang("ns/j").pods(2, cards=8).build(),
            [("sn-a-node-01", ALL8), ("sn-a-node-02", ALL8)],
            id="Required without a name goes to the best-fitting supernode",
        ),
        pytest.param(
            [supernode("sn-a").build(), supernode("sn-b").build()],
            [],
            gang("ns/j").pods(6, cards=8).build(),
            "InsufficientCards",
            id="Required never spans supernodes",
        ),
        pytest.param(
            [A4.build()],
            [held("sn-a-node-00", 0), held("sn-a-node-01", 0)],
            gang("ns/j").pods(3, cards=8).build(),
            "Fragmented",
            id="enough free cards in the wrong shape is Fragmented",
        ),
    ],
)
def test_placement_rule(
    topologies: list[model.SuperNodeTopology],
    holdings: list[model.Holding],
    request_: model.GangRequest,
    expected: Expected,
) -> None:
    assert as_expected(verdict_of(topologies, holdings, request_)) == expected


def test_preferred_spans_the_fewest_supernodes_on_whole_nodes() -> None:
    topologies = [supernode(f"sn-{x}").build() for x in "abc"]
    holdings = [held("sn-a-node-00", 0)]
    verdict = verdict_of(topologies, holdings, gang("ns/j").pods(6, cards=8).preferred().build())
    assert isinstance(verdict, model.Placement)
    assert verdict.supernodes == ("sn-a", "sn-b")  # 4 on sn-b, the rest on the best fit
    assert all(a.cards == ALL8 for a in verdict.assignments)


def test_preferred_stays_in_one_supernode_when_one_holds_it() -> None:
    topologies = [supernode(f"sn-{x}").build() for x in "ab"]
    verdict = verdict_of(topologies, [], gang("ns/j").pods(3, cards=8).preferred().build())
    assert isinstance(verdict, model.Placement)
    assert verdict.supernodes == ("sn-a",)


def test_group_size_keeps_consecutive_ranks_in_one_rack() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    holdings = [held("sn-a-node-00", 0), held("sn-a-node-01", 0), held("sn-a-node-04", 0)]
    request = gang("ns/j").pods(6, cards=8).group_size(3).build()
    verdict = verdict_of([topology], holdings, request)
    assert isinstance(verdict, model.Placement)
    racks = [rack_of(a.node) for a in verdict.assignments]
    assert racks[0] == racks[1] == racks[2] != racks[3] == racks[4] == racks[5]
    assert 0 not in racks  # rack 0 has only two empty nodes left


def test_a_rank_group_goes_to_the_rack_with_the_least_room_to_spare() -> None:
    topology = supernode("sn-a").racks(2, nodes=4).build()
    holdings = [held("sn-a-node-04", 0)]
    verdict = verdict_of([topology], holdings, gang("ns/j").pods(2, cards=8).group_size(2).build())
    assert isinstance(verdict, model.Placement)
    assert {rack_of(a.node) for a in verdict.assignments} == {1}


def test_a_training_gang_goes_into_the_fewest_racks_filled_in_rank_order() -> None:
    """Rack 0 has 2 whole nodes free, rack 1 three, rack 2 four: six whole-node ranks need two
    racks, the roomiest (rack 2) and, of those that hold the rest, the one with the least room
    (rack 0, filled first). Fragmentation alone would take the racks with the fewest empty
    nodes: 0, then 1, then 2 — three racks, five rack crossings around the ring."""
    topology = supernode("sn-a").racks(3, nodes=4).build()
    used = ["sn-a-node-00", "sn-a-node-01", "sn-a-node-04"]
    holdings = [held(n, *range(8)) for n in used]
    verdict = verdict_of([topology], holdings, gang("ns/j").pods(6, cards=8).build())
    assert isinstance(verdict, model.Placement)
    assert [rack_of(a.node) for a in verdict.assignments] == [0, 0, 2, 2, 2, 2]


def test_ranks_smaller_than_a_node_fill_one_node_and_rack_before_the_next() -> None:
    topology = supernode("sn-a").racks(2, nodes=4).build()
    verdict = verdict_of([topology], [], gang("ns/j").pods(12, cards=4).build())
    assert isinstance(verdict, model.Placement)
    nodes = [a.node for a in verdict.assignments]
    racks = [rack_of(n) for n in nodes]
    assert racks[:8] == [racks[0]] * 8  # one rack, then the next
    assert racks[8:] == [1 - racks[0]] * 4
    assert all(nodes[k] == nodes[k + 1] for k in range(0, 12, 2))  # pairs share a node


def test_of_the_supernodes_that_hold_a_gang_the_one_needing_fewest_racks_wins() -> None:
    """sn-a has fewer free cards (the best fit by cards) but holds 4 whole nodes only in two
    racks; sn-b holds them in one."""
    topologies = [supernode(f"sn-{x}").racks(2, nodes=4).build() for x in "ab"]
    used = ["sn-a-node-00", "sn-a-node-01", "sn-a-node-04", "sn-b-node-00", "sn-b-node-01"]
    holdings = [held(n, *range(8)) for n in used] + [held("sn-a-node-05", 0)]
    verdict = verdict_of(topologies, holdings, gang("ns/j").pods(4, cards=8).build())
    assert isinstance(verdict, model.Placement)
    assert verdict.supernodes == ("sn-b",)
    assert {rack_of(a.node) for a in verdict.assignments} == {1}


def test_inference_replicas_spread_across_racks() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    holdings = [
        holding("ns/s/r/0").on("sn-a-node-00", [0, 1]).spread("ns/s/r").build(),
        holding("ns/s/r/1").on("sn-a-node-04", [0, 1]).spread("ns/s/r").build(),
    ]
    request = gang("ns/s/r/2").pods(1, cards=2).spread("ns/s/r").build()
    verdict = verdict_of([topology], holdings, request)
    assert isinstance(verdict, model.Placement)
    assert rack_of(verdict.assignments[0].node) == 2


def test_spread_ties_go_to_the_lowest_fragmentation() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    holdings = [held("sn-a-node-09", 0, 1, 2, 3)]  # rack 2 has a partially used node
    request = gang("ns/s/r/0").pods(1, cards=4).spread("ns/s/r").build()
    verdict = verdict_of([topology], holdings, request)
    assert isinstance(verdict, model.Placement)
    assert verdict.assignments[0].node == "sn-a-node-09"


def test_the_pods_of_one_replica_stay_in_the_fewest_racks() -> None:
    """EP320's decode replica: 40 whole nodes of a 12-rack supernode take 10 racks, filled in
    rank order (its pods talk to each other; spreading is for its replicas)."""
    verdict = verdict_of(
        [cloudmatrix().build()],
        [],
        gang("ns/ds/decode/0").pods(40, cards=8).spread("ns/ds/decode").on("sn-a").build(),
    )
    assert isinstance(verdict, model.Placement)
    racks = [rack_of(a.node) for a in verdict.assignments]
    assert len(set(racks)) == 10
    assert racks == sorted(racks, key=racks.index)  # each rack's ranks together
    assert "sn-a-node-47" not in {a.node for a in verdict.assignments}  # the spare


def test_a_replica_of_several_pods_goes_to_racks_without_its_role_and_stays_together() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    holdings = [
        holding("ns/s/r/0/0").on("sn-a-node-00", [0, 1, 2, 3]).spread("ns/s/r").build(),
        holding("ns/s/r/1/0").on("sn-a-node-04", [0, 1, 2, 3]).spread("ns/s/r").build(),
    ]
    request = gang("ns/s/r/2").pods(3, cards=4).spread("ns/s/r").build()
    verdict = verdict_of([topology], holdings, request)
    assert isinstance(verdict, model.Placement)
    assert {rack_of(a.node) for a in verdict.assignments} == {2}  # the rack without the role
    assert len({a.node for a in verdict.assignments}) == 2  # 3 × 4 cards on two nodes


def test_a_gang_that_does_not_fit_leaves_no_trace() -> None:
    snapshot = engine.Snapshot.build([A4.build()], [held("sn-a-node-00", 0)])
    before = list(snapshot.holdings()), list(snapshot.free), snapshot.stats()
    verdict = engine.place(snapshot, gang("ns/j").pods(4, cards=8).build())
    assert isinstance(verdict, model.Unplaceable)
    assert (list(snapshot.holdings()), list(snapshot.free), snapshot.stats()) == before


def test_place_does_not_change_the_snapshot_and_commit_does() -> None:
    snapshot = engine.Snapshot.build([A4.build()], [])
    request = gang("ns/j").pods(2, cards=8).build()
    first = engine.place(snapshot, request)
    assert first == engine.place(snapshot, request)
    assert isinstance(first, model.Placement)
    snapshot.commit(first)
    assert snapshot.free_cards(inventory.NodeName("sn-a-node-00")) == frozenset()
    second = engine.place(snapshot, gang("ns/k").pods(2, cards=8).build())
    assert isinstance(second, model.Placement)
    assert {a.node for a in second.assignments}.isdisjoint(a.node for a in first.assignments)
    snapshot.release(model.GangKey("ns/j"))
    assert snapshot.stats().free == 4 * 8


def test_commit_of_cards_already_held_is_a_broken_invariant() -> None:
    snapshot = engine.Snapshot.build([A4.build()], [held("sn-a-node-00", 0)])
    stale = model.Placement(
        model.GangKey("ns/j"),
        (
            model.Assignment(
                model.PodKey("ns/j-0"), inventory.NodeName("sn-a-node-00"), (model.CardId(0),)
            ),
        ),
    )
    with pytest.raises(engine.StaleSnapshotError):
        snapshot.commit(stale)


def test_a_half_bound_gang_keeps_its_cards_and_is_finished() -> None:
    holdings = [holding("ns/j").pod(0).on("sn-a-node-02", range(8)).build()]
    snapshot = engine.Snapshot.build([A4.build()], holdings)
    verdict = engine.place(snapshot, gang("ns/j").pods(3, cards=8).build())
    assert isinstance(verdict, model.Placement)
    assert verdict.assignments[0] == model.Assignment(
        model.PodKey("ns/j-0"), inventory.NodeName("sn-a-node-02"), ALL8, "sn-a"
    )
    assert len({a.node for a in verdict.assignments}) == 3
    snapshot.commit(verdict)  # the kept pod is not taken twice


def test_a_kept_pod_on_a_node_gone_not_ready_is_committed_as_it_is() -> None:
    topology = A4.not_ready(2).build()
    holdings = [holding("ns/j").pod(0).on("sn-a-node-02", range(8)).build()]
    snapshot = engine.Snapshot.build([topology], holdings)
    verdict = engine.place(snapshot, gang("ns/j").pods(2, cards=8).build())
    assert isinstance(verdict, model.Placement)
    assert verdict.assignments[0].node == "sn-a-node-02"
    assert verdict.assignments[1].node != "sn-a-node-02"
    snapshot.commit(verdict)


def test_placements_are_deterministic_whatever_the_input_order() -> None:
    topologies = [supernode(f"sn-{x}").racks(2, nodes=2).build() for x in "abc"]
    holdings = [held("sn-b-node-00", 0, 1), held("sn-c-node-03", 5)]
    request = gang("ns/j").pods(5, cards=2).preferred().build()
    one = engine.place(engine.Snapshot.build(topologies, holdings), request)
    other = engine.place(engine.Snapshot.build(topologies[::-1], holdings[::-1]), request)
    assert one == other


def test_the_engine_and_the_supernode_status_choose_the_same_spares() -> None:
    topology = cloudmatrix(spares=2).unhealthy(47, 3).build()
    holdings = [held("sn-a-node-46", 0)]
    snapshot = engine.Snapshot.build([topology], holdings)
    infos = [
        inventory.NodeInfo(
            s.name,
            {},
            True,
            {topology.card_resource: s.cards},
            frozenset(range(s.cards)) - {int(c) for c in s.usable or range(s.cards)},
        )
        for s in sorted(topology.nodes, key=lambda s: s.name)
    ]
    summary = inventory.summarize(infos, topology.card_resource, {h.node: 1 for h in holdings}, 2)
    assert snapshot.spare_nodes("sn-a") == summary.spare_nodes == ("sn-a-node-44", "sn-a-node-45")


def test_an_odd_node_in_a_rack_is_used_by_size() -> None:
    topology = supernode("sn-a").racks(1, nodes=1).with_node(node("sn-a-node-99").cards(4)).build()
    verdict = verdict_of([topology], [], gang("ns/j").pods(1, cards=4).build())
    assert isinstance(verdict, model.Placement)
    assert verdict.assignments[0].node == "sn-a-node-99"  # the smallest empty node that holds it


@pytest.mark.parametrize(
    ("request_", "code", "field"),
    [
        pytest.param(
            gang("ns/j").pods(1, cards=8).on("sn-x").build(),
            "UnknownSuperNode",
            "spec.superNode",
            id="an unknown supernode is permanent",
        ),
        pytest.param(
            gang("ns/j").pods(1, cards=12).build(),
            "NodeTooSmall",
            "spec.cardsPerReplica 12",
            id="a pod bigger than every node is permanent",
        ),
        pytest.param(
            gang("ns/j").pods(1, cards=6).build(),
            "CardGroupMismatch",
            "spec.cardsPerReplica 6",
            id="a pod above a card group but not a multiple of it is permanent",
        ),
        pytest.param(
            gang("ns/j").pods(48, cards=8).on("sn-a").build(),
            "TooManyCards",
            "spec.superNode sn-a",
            id="a Required gang that only the spares could complete is permanent",
        ),
        pytest.param(
            gang("ns/j").pods(8, cards=8).on("sn-a").group_size(8).build(),
            "GroupTooLarge",
            "spec.placement.groupSize 8",
            id="more grouped ranks than any rack holds is permanent",
        ),
    ],
)
def test_specs_that_can_never_be_served(request_: model.GangRequest, code: str, field: str) -> None:
    topologies = [cloudmatrix().build()]
    verdict = engine.check_servable(topologies, request_)
    assert verdict is not None
    assert verdict.permanent
    assert verdict.reasons[0].code == code
    assert field in verdict.reasons[0].message
    assert engine.place(engine.Snapshot.build(topologies, []), request_) == verdict


@pytest.mark.parametrize(
    "request_",
    [
        pytest.param(gang("ns/j").pods(47, cards=8).on("sn-a").build(), id="all but the spare"),
        pytest.param(
            gang("ns/j").pods(48, cards=8).on("sn-a").preferred().build(),
            id="a Preferred gang may outgrow its supernode",
        ),
        pytest.param(
            gang("ns/j").pods(100, cards=8).build(), id="an unnamed gang may wait for room"
        ),
        pytest.param(gang("ns/j").pods(2, cards=4).build(), id="a card group's worth"),
    ],
)
def test_specs_that_may_be_served(request_: model.GangRequest) -> None:
    assert engine.check_servable([cloudmatrix().build()], request_) is None


@pytest.mark.parametrize("named", [True, False])
def test_a_supernode_whose_selector_matches_no_node_says_so(named: bool) -> None:
    """Issue 32, item 5: not "more than the 0 cards of the largest node"."""
    empty = model.SuperNodeTopology("sn-empty", "huawei.com/Ascend910", ())
    builder = gang("ns/j").pods(1, cards=8)
    verdict = engine.check_servable([empty], (builder.on("sn-empty") if named else builder).build())
    assert verdict is not None
    assert verdict.permanent
    assert verdict.reasons[0].code == "NoNodes"
    assert "spec.nodeSelector" in verdict.reasons[0].message
    assert "sn-empty" in verdict.reasons[0].message


def test_the_spec_field_of_inference_cards_is_named() -> None:
    request = model.GangRequest(
        model.GangKey("ns/s/decode/0"),
        (model.PodRequest(model.PodKey("ns/s-decode-0-0"), 9),),
        priority=1000,
        cards_field="spec.roles[decode].cardsPerPod",
    )
    verdict = engine.check_servable([cloudmatrix().build()], request)
    assert verdict is not None
    assert verdict.reasons[0].message.startswith("spec.roles[decode].cardsPerPod 9")


def rack_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1]) // 4
