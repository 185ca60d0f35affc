"""A training gang waits for the cards of pods going away when they give it fewer racks.

A deleted gang's pods go one by one; a gang placed while they go takes the first freed nodes
of several racks where, a second later, whole racks are free (``engine.LEAVING``).
"""

from __future__ import annotations

import dataclasses

from matrixpool.k8s import convert
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


def test_a_pod_counts_as_leaving_only_while_its_grace_ends_soon_and_not_long_overdue() -> None:
    """A pod stuck in Terminating (a finalizer, a kubelet that cannot kill it) must not hold a
    gang back for good; nor is a gang held for a pod whose grace runs for many minutes."""
    now = 1_000_000.0
    pod = running("a", 1)[0]

    def going(gone_by: float) -> bool:
        return world.leaving(dataclasses.replace(pod, deleting=True, gone_by=gone_by), True, now)

    assert going(now + 30)  # the default grace, just begun
    assert going(now - 5)  # overdue by a few seconds: the kubelet is still at it
    assert not going(now - 6)  # long overdue: stuck
    assert not going(now + 31)  # a grace of minutes: not worth waiting for
    assert world.leaving(dataclasses.replace(pod, deleting=True), True, now)  # no time said
    assert world.leaving(pod, False, now)  # its workload is gone: deleted next
    assert not world.leaving(pod, True, now)  # stays


def test_a_pods_deletion_time_is_read_from_its_metadata() -> None:
    labels = {"matrixpool.dev/job": "a", "matrixpool.dev/rank": "0"}
    meta = {"uid": "u", "deletionTimestamp": "2026-12-05T11:00:30Z"}
    facts = convert.pod_facts("a-0", "ns", labels, {}, {}, {}, meta)
    assert facts is not None
    assert facts.deleting
    assert facts.gone_by == 1796468430.0
    alive = convert.pod_facts("a-0", "ns", labels, {}, {}, {}, {"uid": "u"})
    assert alive is not None
    assert alive.gone_by == 0.0


def test_a_gang_that_waits_for_leaving_pods_says_so_in_its_event() -> None:
    """The cycle's reason for a gang that waits for fewer racks is its own, not the one
    for a preemptor's victims going."""
    import asyncio

    from matrixpool.api import supernode as api_supernode
    from matrixpool.controllers.scheduling import cycle as scheduler
    from matrixpool.controllers.scheduling import cyclestate
    from matrixpool.state import assumed as assuming
    from tests.unit.recorder import Recorder
    from tests.unit.worlds import pod

    # racks of two nodes: old-0 on n0 (going) and old-1 on n2 (staying) leave n1 and n3 free
    going = pod("old-0", "u0", node="n0", cards=frozenset(WHOLE), phase="Running")
    going = dataclasses.replace(going, deleting=True)
    staying = pod("old-1", "u1", node="n2", cards=frozenset(WHOLE), phase="Running")
    flat = fixed_world(index(going, staying), [job("old", 2), job("new", 2)])
    racked = api_supernode.parse(
        {
            "apiVersion": "matrixpool.dev/v1alpha1",
            "kind": "SuperNode",
            "metadata": {"name": "sn-a", "uid": "uid-sn-a"},
            "spec": {
                "nodeSelector": {"matchLabels": {"sn": "a"}},
                "cardResource": "huawei.com/Ascend910",
                "cardsPerNode": 8,
                "topologyKeys": ["matrixpool.dev/rack"],
            },
        }
    )
    seen = dataclasses.replace(flat, supernodes={"sn-a": racked})

    async def scenario() -> Recorder:
        act = Recorder()
        await scheduler.run_cycle(lambda: seen, cyclestate.Memory(), assuming.Assumed(), act)
        return act

    act = asyncio.run(scenario())
    assert act.bound_to == {}  # n1 and n3 now would cross 2 racks; n0 and n1 soon, 1
    reasons = [(name, reason) for name, _, reason, _ in act.events if name == "new"]
    assert reasons == [("new", engine.LEAVING)]
