"""Preemption: strictly lower priorities only, elastic gangs shrink first, the least lost work,
inside the domain the preemptor goes to."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from matrixpool.placement import engine, model, preemption
from tests.builders import GangBuilder, gang, holding, supernode

ALL8 = range(8)


def running(
    builder: GangBuilder, nodes: Sequence[str]
) -> tuple[model.GangRequest, list[model.Holding]]:
    """A gang of whole-node pods holding ``nodes`` (one pod per node, in rank order)."""
    request = builder.pods(len(nodes), cards=8).build()
    holdings = [
        holding(request.gang).pod(rank).on(name, ALL8).priority(request.priority).build()
        for rank, name in enumerate(nodes)
    ]
    return request, holdings


def node_names(supernode_name: str, *indices: int) -> list[str]:
    return [f"{supernode_name}-node-{k:02d}" for k in indices]


def preempt(
    topologies: list[model.SuperNodeTopology],
    victims: list[tuple[model.GangRequest, list[model.Holding]]],
    request: model.GangRequest,
) -> model.Preemption | model.Unplaceable:
    snapshot = engine.Snapshot.build(topologies, [h for _, hs in victims for h in hs])
    return engine.preempt(snapshot, request, {v.gang: v for v, _ in victims})


A = [supernode("sn-a").racks(1, nodes=4).build()]
NEWCOMER = gang("ns/new").priority(100)


@pytest.mark.parametrize(
    ("victims", "pods", "shrink", "evict"),
    [
        pytest.param(
            [running(gang("ns/el").priority(10).elastic(2), node_names("sn-a", 0, 1, 2, 3))],
            2,
            {"ns/el": 2},
            (),
            id="an elastic gang shrinks before anyone is evicted",
        ),
        pytest.param(
            [running(gang("ns/el").priority(10).elastic(1), node_names("sn-a", 0, 1, 2, 3))],
            1,
            {"ns/el": 3},
            (),
            id="a shrunk gang keeps as many ranks as the newcomer allows",
        ),
        pytest.param(
            [
                running(gang("ns/big").priority(10), node_names("sn-a", 0, 1)),
                running(gang("ns/s1").priority(10), node_names("sn-a", 2)),
                running(gang("ns/s2").priority(10), node_names("sn-a", 3)),
            ],
            2,
            {},
            ("ns/big",),
            id="the fewest victims: one big gang rather than two small ones",
        ),
        pytest.param(
            [
                running(gang("ns/p20").priority(20), node_names("sn-a", 0, 1)),
                running(gang("ns/p10").priority(10), node_names("sn-a", 2, 3)),
            ],
            2,
            {},
            ("ns/p10",),
            id="the lowest priority goes first",
        ),
        pytest.param(
            [
                running(gang("ns/p10").priority(10), node_names("sn-a", 0)),
                running(gang("ns/p20").priority(20), node_names("sn-a", 1, 2)),
                running(gang("ns/p200").priority(200), node_names("sn-a", 3)),
            ],
            2,
            {},
            ("ns/p20",),
            id="a victim the fit does not need is spared",
        ),
        pytest.param(
            [
                running(gang("ns/el").priority(10).elastic(3), node_names("sn-a", 0, 1, 2, 3)),
            ],
            2,
            {},
            ("ns/el",),
            id="an elastic gang whose floor is not enough is evicted",
        ),
    ],
)
def test_preemption_plan(
    victims: list[tuple[model.GangRequest, list[model.Holding]]],
    pods: int,
    shrink: dict[str, int],
    evict: tuple[str, ...],
) -> None:
    request = gang("ns/new").priority(100).pods(pods, cards=8).build()
    verdict = preempt(A, victims, request)
    assert isinstance(verdict, model.Preemption)
    assert (verdict.shrink, verdict.evict) == (shrink, evict)
    assert len(verdict.placement.assignments) == pods


@pytest.mark.parametrize(
    "victim",
    [
        pytest.param(gang("ns/same").priority(100), id="an equal priority is never touched"),
        pytest.param(gang("ns/high").priority(500), id="a higher priority is never touched"),
        pytest.param(
            gang("ns/np").priority(1).not_preemptible(),
            id="a non-preemptible gang is never touched",
        ),
    ],
)
def test_preemption_never_takes_from(victim: GangBuilder) -> None:
    verdict = preempt(
        A, [running(victim, node_names("sn-a", 0, 1, 2, 3))], NEWCOMER.pods(1, 8).build()
    )
    assert isinstance(verdict, model.Unplaceable)
    assert [r.code for r in verdict.reasons] == ["InsufficientCards", "NoVictims"]


def test_shrinking_drops_the_highest_ranks_and_the_plan_commits() -> None:
    victim = running(gang("ns/el").priority(10).elastic(1), node_names("sn-a", 0, 1, 2, 3))
    snapshot = engine.Snapshot.build(A, victim[1])
    verdict = engine.preempt(snapshot, NEWCOMER.pods(2, 8).build(), {victim[0].gang: victim[0]})
    assert isinstance(verdict, model.Preemption)
    assert verdict.shrink == {"ns/el": 2}
    assert {a.node for a in verdict.placement.assignments} == set(node_names("sn-a", 2, 3))
    assert list(snapshot.holdings()) == victim[1]  # preempt leaves the snapshot alone
    snapshot.release_pods(victim[0].gang, [p.pod for p in victim[0].pods[2:]])
    snapshot.commit(verdict.placement)


def test_an_unnamed_required_gang_preempts_where_the_fewest_victims_are() -> None:
    topologies = [supernode(name).racks(1, nodes=4).build() for name in ("sn-a", "sn-b")]
    victims = [
        running(gang("ns/a1").priority(10), node_names("sn-a", 0, 1)),
        running(gang("ns/a2").priority(10), node_names("sn-a", 2, 3)),
        running(gang("ns/b1").priority(20), node_names("sn-b", 0, 1, 2, 3)),
    ]
    verdict = preempt(topologies, victims, gang("ns/new").priority(100).pods(4, cards=8).build())
    assert isinstance(verdict, model.Preemption)
    assert verdict.evict == ("ns/b1",)
    assert verdict.placement.supernodes == ("sn-b",)


def test_a_gang_that_fits_needs_no_victims() -> None:
    verdict = preempt(A, [], gang("ns/new").pods(1, cards=8).build())
    assert isinstance(verdict, model.Preemption)
    assert (verdict.shrink, verdict.evict) == ({}, ())


def test_a_spec_that_can_never_be_served_preempts_nobody() -> None:
    victims = [running(gang("ns/low").priority(1), node_names("sn-a", 0))]
    verdict = preempt(A, victims, gang("ns/new").priority(100).pods(1, cards=9).build())
    assert isinstance(verdict, model.Unplaceable)
    assert verdict.permanent


TWO_RACKS = [supernode("sn-a").racks(2, nodes=2).build()]  # rack-00: nodes 0, 1; rack-01: 2, 3


@pytest.mark.parametrize(
    ("victims", "pods", "evict"),
    [
        pytest.param(
            [
                running(gang("ns/stale").priority(10).loses(3600), node_names("sn-a", 0, 1)),
                running(gang("ns/fresh").priority(10).loses(60), node_names("sn-a", 2, 3)),
            ],
            2,
            ("ns/fresh",),
            id="at equal priority and size the gang with the freshest checkpoint goes",
        ),
        pytest.param(
            [
                running(gang("ns/p10").priority(10).loses(3600), node_names("sn-a", 0, 1)),
                running(gang("ns/p20").priority(20).loses(60), node_names("sn-a", 2, 3)),
            ],
            2,
            ("ns/p20",),
            id="less lost work beats a lower priority",
        ),
        pytest.param(
            [
                running(gang("ns/big").priority(10).loses(100), node_names("sn-a", 0, 1)),
                running(gang("ns/s1").priority(10).loses(30), node_names("sn-a", 2)),
                running(gang("ns/s2").priority(10).loses(30), node_names("sn-a", 3)),
            ],
            2,
            ("ns/s1", "ns/s2"),
            id="two victims that lose less beat one that loses more",
        ),
    ],
)
def test_the_least_lost_work_wins(
    victims: list[tuple[model.GangRequest, list[model.Holding]]],
    pods: int,
    evict: tuple[str, ...],
) -> None:
    request = gang("ns/new").priority(100).pods(pods, cards=8).build()
    verdict = preempt(A, victims, request)
    assert isinstance(verdict, model.Preemption)
    assert (verdict.shrink, verdict.evict) == ({}, evict)


def test_an_elastic_gang_shrinks_even_when_an_eviction_would_lose_less() -> None:
    victims = [
        running(gang("ns/el").priority(10).elastic(2).loses(3600), node_names("sn-a", 0, 1, 2)),
        running(gang("ns/cheap").priority(10).loses(1), node_names("sn-a", 3)),
    ]
    verdict = preempt(A, victims, NEWCOMER.pods(1, cards=8).build())
    assert isinstance(verdict, model.Preemption)
    assert (verdict.shrink, verdict.evict) == ({"ns/el": 2}, ())


def test_a_one_rack_preemptor_evicts_one_whole_gang_in_one_rack_not_pieces() -> None:
    """The smallest-set rule takes the two lowest priorities, one node each in rack-00; a rack
    scope finds that rack-01's one gang alone makes room, for the same lost work."""
    victims = [
        running(gang("ns/a").priority(10).loses(100), node_names("sn-a", 0)),
        running(gang("ns/b").priority(10).loses(100), node_names("sn-a", 1)),
        running(gang("ns/whole").priority(20).loses(100), node_names("sn-a", 2, 3)),
    ]
    request = NEWCOMER.pods(2, cards=8).group_size(2).build()
    snapshot = engine.Snapshot.build(TWO_RACKS, [h for _, hs in victims for h in hs])
    requests = {v.gang: v for v, _ in victims}
    old = engine.preempt(snapshot, request, requests, rule=preemption.SMALLEST_SET)
    assert isinstance(old, model.Preemption)
    assert old.evict == ("ns/a", "ns/b")
    verdict = engine.preempt(snapshot, request, requests)
    assert isinstance(verdict, model.Preemption)
    assert verdict.evict == ("ns/whole",)
    assert {a.node for a in verdict.placement.assignments} == set(node_names("sn-a", 2, 3))


def test_a_victim_whose_cards_the_preemptor_does_not_take_is_spared() -> None:
    """A heuristic fit may need a victim that frees nothing it uses; sparing it is checked on
    a plan built by hand: the victim outside the placement's nodes keeps its pods."""
    victims = [
        running(gang("ns/in").priority(10), node_names("sn-a", 0, 1)),
        running(gang("ns/out").priority(10), node_names("sn-a", 2)),
    ]
    snapshot = engine.Snapshot.build(TWO_RACKS, [h for _, hs in victims for h in hs])
    search = preemption._Search(
        snapshot,
        NEWCOMER.pods(2, cards=8).group_size(2).build(),
        [v for v, _ in victims],
        engine._fits,
    )
    search.evict = ["ns/in", "ns/out"]
    search.spare_outside()
    assert search.evict == ["ns/in"]
