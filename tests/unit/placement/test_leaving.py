"""A training gang waits for the cards of pods going away when they give it fewer racks.

A deleted gang's pods go one by one; a gang placed while they go takes the first freed nodes
of several racks where, a second later, whole racks are free (``engine.LEAVING``).
"""

from __future__ import annotations

import dataclasses

from matrixpool.placement import engine, model
from matrixpool.state import world
from tests.builders import gang, holding, supernode
from tests.unit.worlds import fixed_world, index, job, running

WHOLE = tuple(range(8))


def held(key: str, node_name: str, *, rank: int = 0, leaving: bool = False) -> model.Holding:
    """Rank ``rank`` of gang ``key`` on the whole of ``node_name``, priority 1."""
    found = holding(key).pod(rank).on(node_name, WHOLE).priority(1).build()
    return dataclasses.replace(found, leaving=leaving)


def rack_of(name: str) -> int:
    return int(name.rsplit("-", 1)[1]) // 4


def half_gone() -> list[model.Holding]:
    """Three racks of 4 nodes. Racks 1 and 2: two nodes held by a gang that stays. Rack 0: an
    old gang of 4 nodes is being deleted, two of its pods are gone, two still hold their
    nodes. Now 4 whole nodes are free in three racks, two in each; once the old gang is gone
    rack 0 is whole."""
    stays = [held("ns/stays", f"sn-a-node-{n:02d}", rank=k) for k, n in enumerate((4, 5, 8, 9))]
    old = [held("ns/old", f"sn-a-node-{n:02d}", rank=n, leaving=True) for n in (2, 3)]
    return stays + old


def test_a_gang_waits_for_pods_going_away_when_they_leave_it_fewer_racks() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    snapshot = engine.Snapshot.build([topology], half_gone())
    verdict = engine.place(snapshot, gang("ns/j").pods(4, cards=8).build())
    assert isinstance(verdict, model.Unplaceable)
    assert verdict.reasons[0].code == engine.LEAVING
    assert not verdict.permanent


def test_it_places_now_when_nothing_goes_away() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    staying = [dataclasses.replace(h, leaving=False) for h in half_gone()]
    verdict = engine.place(
        engine.Snapshot.build([topology], staying), gang("ns/j").pods(4, cards=8).build()
    )
    assert isinstance(verdict, model.Placement)
    assert len({rack_of(a.node) for a in verdict.assignments}) == 2


def test_it_places_now_when_waiting_would_save_no_rack() -> None:
    """Two whole nodes free in each of three racks, one node of rack 1 going away: four nodes
    take two racks now, and still two once it is gone."""
    topology = supernode("sn-a").racks(3, nodes=4).build()
    stays = [held("ns/stays", f"sn-a-node-{n:02d}", rank=k) for k, n in enumerate((2, 3, 5, 8, 9))]
    holdings = [*stays, held("ns/old", "sn-a-node-04", leaving=True)]
    verdict = engine.place(
        engine.Snapshot.build([topology], holdings), gang("ns/j").pods(4, cards=8).build()
    )
    assert isinstance(verdict, model.Placement)
    assert len({rack_of(a.node) for a in verdict.assignments}) == 2


def test_once_they_are_gone_it_takes_the_whole_rack() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    gone = [h for h in half_gone() if h.gang != "ns/old"]
    verdict = engine.place(
        engine.Snapshot.build([topology], gone), gang("ns/j").pods(4, cards=8).build()
    )
    assert isinstance(verdict, model.Placement)
    assert {rack_of(a.node) for a in verdict.assignments} == {0}


def test_rank_groups_and_inference_replicas_do_not_wait() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    snapshot = engine.Snapshot.build([topology], half_gone())
    grouped = gang("ns/g").pods(4, cards=8).group_size(2).build()
    replica = gang("ns/s/decode/0").pods(4, cards=8).spread("ns/s/decode").build()
    for request in (grouped, replica):
        assert isinstance(engine.place(snapshot, request), model.Placement)


def test_preemption_for_a_waiting_gang_evicts_nobody_and_names_the_racks_it_waits_for() -> None:
    """The scheduler asks preemption for a gang that does not fit: one that waits for pods
    going away gets the placement it waits for, with no victim (the cards are being freed),
    so the free part of it is held for it against the gangs after it in the cycle."""
    topology = supernode("sn-a").racks(3, nodes=4).build()
    snapshot = engine.Snapshot.build([topology], half_gone())
    request = gang("ns/j").pods(4, cards=8).priority(10).build()
    victims = {h.gang: gang(h.gang).pods(4, cards=8).priority(1).build() for h in half_gone()}
    plan = engine.preempt(snapshot, request, victims)
    assert isinstance(plan, model.Preemption)
    assert (plan.evict, plan.shrink) == ((), {})
    assert {rack_of(a.node) for a in plan.placement.assignments} == {0}


def test_the_snapshot_keeps_which_pods_go_away() -> None:
    topology = supernode("sn-a").racks(3, nodes=4).build()
    snapshot = engine.Snapshot.build([topology], half_gone())
    assert sorted(h.pod for h in snapshot.holdings() if h.leaving) == ["ns/old-2", "ns/old-3"]
    assert sorted(h.pod for h in snapshot.copy().holdings() if h.leaving) == [
        "ns/old-2",
        "ns/old-3",
    ]


def test_pods_deleting_or_of_a_workload_gone_are_leaving_unless_their_node_is_down() -> None:
    deleting = [dataclasses.replace(p, deleting=True) for p in running("a", 2)]
    orphans = running("b", 2, first_node=2)
    seen = fixed_world(index(*deleting, *orphans), [job("a", 2)], down=frozenset({"n1"}))
    leaving = {h.pod: h.leaving for h in world.holdings(seen)}
    assert leaving == {"ns/a-0": True, "ns/a-1": False, "ns/b-0": True, "ns/b-1": True}
    kept = fixed_world(index(*running("a", 2)), [job("a", 2)])
    assert not any(h.leaving for h in world.holdings(kept))
