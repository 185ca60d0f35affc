"""Placement invariants over random topologies and gang streams (hypothesis).

No card is used twice, gangs are all-or-nothing, spares and unhealthy cards stay untouched,
capacity is never exceeded, ``Required`` gangs stay in one supernode, card groups and rank
groups are respected, the incremental indexes match a rebuild, and preemption only ever takes
from strictly lower, preemptible priorities.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrixpool.placement import cards, engine, model
from tests.builders import gang, supernode

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GROUPS = {4: ((0, 1), (2, 3)), 8: ((0, 1, 2, 3), (4, 5, 6, 7))}


@st.composite
def topologies(draw: st.DrawFn) -> list[model.SuperNodeTopology]:
    result = []
    for k in range(draw(st.integers(1, 3))):
        size = draw(st.sampled_from([4, 8]))
        racks, per_rack = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        builder = supernode(f"sn-{k}").racks(racks, nodes=per_rack).cards(size)
        builder = builder.spares(draw(st.integers(0, 1)))
        if draw(st.booleans()):
            builder = builder.groups(*GROUPS[size])
        for index in range(racks * per_rack):
            health = draw(st.sampled_from(["ok", "ok", "ok", "bad card", "down"]))
            if health == "bad card":
                builder = builder.unhealthy(index, draw(st.integers(0, size - 1)))
            elif health == "down":
                builder = builder.not_ready(index)
        result.append(builder.build())
    return result


@st.composite
def requests(draw: st.DrawFn, key: str, names: list[str]) -> model.GangRequest:
    builder = gang(key).priority(draw(st.integers(0, 3)))
    builder = builder.pods(draw(st.integers(1, 5)), cards=draw(st.sampled_from([1, 2, 3, 4, 8])))
    if draw(st.booleans()):
        builder = builder.on(draw(st.sampled_from(names)))
    if draw(st.booleans()):
        builder = builder.preferred()
    if draw(st.integers(0, 3)) == 0:
        builder = builder.group_size(2)
    if draw(st.integers(0, 2)) == 0:
        builder = builder.spread("role")
    if draw(st.booleans()):
        builder = builder.elastic(draw(st.integers(1, 3)))
    return builder.build()


@st.composite
def worlds(draw: st.DrawFn) -> tuple[list[model.SuperNodeTopology], list[model.GangRequest]]:
    tops = draw(topologies())
    names = [t.name for t in tops]
    count = draw(st.integers(1, 10))
    return tops, [draw(requests(f"ns/g{k}", names)) for k in range(count)]


@SETTINGS
@given(worlds())
def test_every_placement_keeps_the_invariants(
    world: tuple[list[model.SuperNodeTopology], list[model.GangRequest]],
) -> None:
    tops, stream = world
    snapshot = engine.Snapshot.build(tops, [])
    for request in stream:
        before = (list(snapshot.holdings()), list(snapshot.free), snapshot.stats())
        verdict = engine.place(snapshot, request)
        assert (list(snapshot.holdings()), list(snapshot.free), snapshot.stats()) == before
        if isinstance(verdict, model.Placement):
            check_placement(tops, snapshot, request, verdict)
            snapshot.commit(verdict)
    check_holdings(tops, snapshot)
    check_indexes(tops, snapshot)


def check_placement(
    tops: list[model.SuperNodeTopology],
    snapshot: engine.Snapshot,
    request: model.GangRequest,
    placement: model.Placement,
) -> None:
    """All pods, in rank order, on free cards (never spares, unhealthy or NotReady), each card
    once; one supernode when Required; card groups and rank groups kept."""
    slots = {s.name: s for t in tops for s in t.nodes}
    assert [a.pod for a in placement.assignments] == [p.pod for p in request.pods]
    taken: set[tuple[str, int]] = set()
    for pod, a in zip(request.pods, placement.assignments, strict=True):
        assert len(a.cards) == pod.cards
        assert set(a.cards) <= snapshot.free_cards(a.node)
        assert taken.isdisjoint((a.node, c) for c in a.cards)
        taken.update((a.node, c) for c in a.cards)
        check_card_groups(slots[a.node], a.cards)
    if request.affinity is model.Affinity.REQUIRED:
        assert len(placement.supernodes) == 1
        assert request.supernode in (None, placement.supernodes[0])
    if request.group_size:
        for start in range(0, len(request.pods), request.group_size):
            chunk = placement.assignments[start : start + request.group_size]
            assert len({(a.supernode, slots[a.node].domains) for a in chunk}) == 1


def check_card_groups(slot: model.NodeSlot, taken: tuple[model.CardId, ...]) -> None:
    groups = [{int(c) for c in g} for g in slot.card_groups] or [set(range(slot.cards))]
    largest = max(len(g) for g in groups)
    if len(taken) <= largest:
        assert any(set(taken) <= g for g in groups)
    else:
        assert all(g <= set(taken) or g.isdisjoint(taken) for g in groups)


def check_holdings(tops: list[model.SuperNodeTopology], snapshot: engine.Snapshot) -> None:
    """Disjoint cards per node, within the healthy cards of Ready non-spare nodes."""
    slots: dict[str, model.NodeSlot] = {s.name: s for t in tops for s in t.nodes}
    spares = {n for t in tops for n in snapshot.spare_nodes(t.name)}
    used: dict[str, set[int]] = defaultdict(set)
    for h in snapshot.holdings():
        assert h.node not in spares
        assert used[h.node].isdisjoint(h.cards)
        used[h.node] |= h.cards
    for name, held in used.items():
        slot = slots[name]
        usable = set(range(slot.cards)) if slot.usable is None else {int(c) for c in slot.usable}
        assert held <= usable


def check_indexes(tops: list[model.SuperNodeTopology], snapshot: engine.Snapshot) -> None:
    """The indexes kept incrementally equal those of a snapshot rebuilt from the holdings."""
    rebuilt = engine.Snapshot.build(tops, snapshot.holdings())
    assert rebuilt.free == snapshot.free
    assert rebuilt.rack_free == snapshot.rack_free
    assert rebuilt.rack_empty == snapshot.rack_empty
    assert rebuilt.rack_partial == snapshot.rack_partial
    assert rebuilt.sn_free == snapshot.sn_free
    assert rebuilt.sn_partial == snapshot.sn_partial
    spread = [{k: v for k, v in d.items() if v} for d in snapshot.rack_spread]
    assert [{k: v for k, v in d.items() if v} for d in rebuilt.rack_spread] == spread
    for r, nodes in enumerate(snapshot.layout.rack_nodes):
        assert snapshot.rack_free[r] == sum(snapshot.free[i].bit_count() for i in nodes)


@SETTINGS
@given(worlds(), st.integers(0, 4), st.integers(1, 4), st.sampled_from([1, 2, 4, 8]))
def test_preemption_takes_only_from_strictly_lower_priorities(
    world: tuple[list[model.SuperNodeTopology], list[model.GangRequest]],
    priority: int,
    pods: int,
    size: int,
) -> None:
    tops, stream = world
    snapshot = engine.Snapshot.build(tops, [])
    for request in stream:
        verdict = engine.place(snapshot, request)
        if isinstance(verdict, model.Placement):
            snapshot.commit(verdict)
    newcomer = gang("ns/new").priority(priority).pods(pods, cards=size).build()
    victims = {r.gang: r for r in stream}
    before = list(snapshot.holdings())
    plan = engine.preempt(snapshot, newcomer, victims)
    assert list(snapshot.holdings()) == before
    if isinstance(plan, model.Unplaceable):
        return
    for key in [*plan.shrink, *plan.evict]:
        assert victims[key].priority < priority
        assert victims[key].preemptible
    assert set(plan.shrink).isdisjoint(plan.evict)
    for key, keep in plan.shrink.items():
        assert (victims[key].min_pods or 0) <= keep < len(victims[key].pods)
        snapshot.release_pods(key, [p.pod for p in victims[key].pods[keep:]])
    for key in plan.evict:
        snapshot.release(key)
    check_placement(tops, snapshot, newcomer, plan.placement)
    snapshot.commit(plan.placement)
    check_holdings(tops, snapshot)


@SETTINGS
@given(st.sets(st.integers(0, 7)), st.integers(1, 8), st.booleans())
def test_a_fitter_takes_free_cards_only(free: set[int], size: int, rings: bool) -> None:
    shape = cards.shape_of(8, GROUPS[8] if rings else ())
    mask = cards.fitter(shape).take(cards.mask_of(free), size)
    assert mask & ~cards.mask_of(free) == 0
    assert mask.bit_count() in (0, size)
