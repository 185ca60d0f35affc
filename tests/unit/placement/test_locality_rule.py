"""The locality wait's rule, pure (``engine.waits_for_fewer_racks``): the controller and
``benchmarks/locality_wait.py`` both decide by it."""

from __future__ import annotations

from matrixpool.placement import engine, model
from tests.builders import gang, holding, supernode

WHOLE = tuple(range(8))


def spread_world() -> tuple[engine.Snapshot, model.Placement]:
    """Two racks of 4 nodes, two nodes of each held: a gang of 4 nodes fits one rack on an
    empty layout but takes two now."""
    snapshot = engine.Snapshot.build([supernode("sn-a").racks(2, nodes=4).build()], staying())
    placed = engine.place(snapshot, gang("ns/j").pods(4, cards=8).build())
    assert isinstance(placed, model.Placement)
    assert engine.racks(snapshot, placed) == (2, 1)
    return snapshot, placed


def test_a_spread_gang_waits_until_its_wait_is_over_counted_from_the_first_look() -> None:
    snapshot, placed = spread_world()
    since: dict[model.GangKey, float] = {}
    assert engine.waits_for_fewer_racks(snapshot, placed, 10, since, now=100.0) == (2, 1)
    assert since == {placed.gang: 100.0}
    assert engine.waits_for_fewer_racks(snapshot, placed, 10, since, now=109.9) == (2, 1)
    assert since == {placed.gang: 100.0}  # the first look stays the start
    assert engine.waits_for_fewer_racks(snapshot, placed, 10, since, now=110.0) is None


def test_no_wait_asked_places_at_once_and_remembers_nothing() -> None:
    snapshot, placed = spread_world()
    since: dict[model.GangKey, float] = {}
    assert engine.waits_for_fewer_racks(snapshot, placed, 0, since, now=100.0) is None
    assert since == {}


def test_a_gang_on_its_fewest_racks_never_waits() -> None:
    snapshot = engine.Snapshot.build([supernode("sn-a").racks(2, nodes=4).build()], [])
    placed = engine.place(snapshot, gang("ns/j").pods(4, cards=8).build())
    assert isinstance(placed, model.Placement)
    since: dict[model.GangKey, float] = {}
    assert engine.waits_for_fewer_racks(snapshot, placed, 10, since, now=100.0) is None
    assert since == {}


def test_a_gang_whose_pods_hold_cards_never_waits() -> None:
    """Rank 0 still holds node 2 (a recovery's hole to fill): the placement spans two racks
    where one could hold it, and still it does not wait."""
    _, placed = spread_world()
    kept = holding("ns/j").pod(0).on("sn-a-node-02", WHOLE).priority(1).build()
    topology = supernode("sn-a").racks(2, nodes=4).build()
    recovering = engine.Snapshot.build([topology], [*staying(), kept])
    assert recovering.kept(placed.gang)
    assert engine.racks(recovering, placed) == (2, 1)
    since: dict[model.GangKey, float] = {}
    assert engine.waits_for_fewer_racks(recovering, placed, 10, since, now=100.0) is None
    assert since == {}


def staying() -> list[model.Holding]:
    """Nodes 0, 1 (rack 0) and 4, 5 (rack 1), whole, held by a gang that stays."""
    return [
        holding("ns/stays").pod(k).on(f"sn-a-node-{n:02d}", WHOLE).priority(1).build()
        for k, n in enumerate((0, 1, 4, 5))
    ]
