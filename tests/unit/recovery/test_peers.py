"""Tier-1 peer assignment (matrixpool_recovery.peers): table rows per rule, then properties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from matrixpool_recovery import peers
from matrixpool_recovery.policy import NodeName

N = NodeName


def racks(**layout: str) -> dict[NodeName, str]:
    """racks(r1="a b", r2="c d") -> {a: r1, b: r1, c: r2, d: r2}."""
    return {N(n): rack for rack, names in layout.items() for n in names.split()}


def one_rank_each(rack_of: dict[NodeName, str]) -> dict[NodeName, list[int]]:
    return {n: [i] for i, n in enumerate(sorted(rack_of))}


@pytest.mark.parametrize(
    ("rack_of", "replicas", "want", "degraded"),
    [
        pytest.param(
            racks(r1="a b", r2="c d"),
            1,
            {"a": ("c",), "b": ("d",), "c": ("b",), "d": ("a",)},
            "",
            id="two racks of two: each node's peer is in the other rack, each holds one copy",
        ),
        pytest.param(
            racks(r1="a b", r2="c d", r3="e f"),
            2,
            {
                "a": ("c", "e"),
                "b": ("d", "f"),
                "c": ("e", "b"),
                "d": ("f", "a"),
                "e": ("b", "d"),
                "f": ("a", "c"),
            },
            "",
            id="two replicas over three racks follow the rack-interleaved ring",
        ),
        pytest.param(
            racks(r1="a b c"),
            1,
            {"a": ("b",), "b": ("c",), "c": ("a",)},
            "one rack only",
            id="one rack only peers inside the rack and says a rack failure loses tier 1",
        ),
        pytest.param(
            racks(r1="a b", r2="c"),
            2,
            {"a": ("c", "b"), "b": ("c", "a"), "c": ("b", "a")},
            "share a rack with some of their peers",
            id="too few nodes in other racks fills from the giver's rack after one away",
        ),
        pytest.param(
            racks(r1="a", r2="b"),
            2,
            {"a": ("b",), "b": ("a",)},
            "fewer than 2 peers",
            id="too few nodes at all gives fewer peers and says so",
        ),
        pytest.param(
            racks(r1="a", r2="b"),
            0,
            {"a": (), "b": ()},
            "",
            id="peerReplicas 0 assigns no peer and is not degraded",
        ),
    ],
)
def test_assign_peers(
    rack_of: dict[NodeName, str], replicas: int, want: dict[str, tuple[str, ...]], degraded: str
) -> None:
    got = peers.assign_peers(one_rank_each(rack_of), rack_of, replicas)
    assert dict(got.peers) == want
    assert degraded in got.degraded
    assert bool(got.degraded) == bool(degraded)


def test_nodes_without_ranks_hold_copies_but_get_no_peers() -> None:
    rack_of = racks(r1="a b", r2="c d")
    got = peers.assign_peers({N("a"): [0, 1], N("b"): [2, 3]}, rack_of, 1)
    assert dict(got.peers) == {"a": ("c",), "b": ("d",)}


# --- properties -------------------------------------------------------------------------------

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw: st.DrawFn) -> tuple[dict[NodeName, list[int]], dict[NodeName, str], int]:
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    rack_of = {N(f"r{k}-n{i}"): f"r{k}" for k, size in enumerate(sizes) for i in range(size)}
    ranks: dict[NodeName, list[int]] = {}
    for node in sorted(rack_of):
        count = draw(st.integers(0, 3))
        ranks[node] = list(
            range(sum(map(len, ranks.values())), sum(map(len, ranks.values())) + count)
        )
    return ranks, rack_of, draw(st.integers(1, 3))


@SETTINGS
@given(layouts())
def test_a_peer_is_in_another_rack_whenever_one_exists(
    layout: tuple[dict[NodeName, list[int]], dict[NodeName, str], int],
) -> None:
    ranks, rack_of, replicas = layout
    got = peers.assign_peers(ranks, rack_of, replicas)
    several = len(set(rack_of.values())) > 1
    for giver, held in got.peers.items():
        assert giver not in held
        assert len(set(held)) == len(held)
        assert len(held) == min(replicas, len(rack_of) - 1)
        assert not several or rack_of[held[0]] != rack_of[giver]
        assert not several or got.degraded or all(rack_of[h] != rack_of[giver] for h in held)
    assert set(got.peers) == {n for n, r in ranks.items() if r}


@SETTINGS
@given(layouts(), st.data())
def test_a_whole_rack_failing_leaves_a_holder_for_every_node(
    layout: tuple[dict[NodeName, list[int]], dict[NodeName, str], int], data: st.DataObject
) -> None:
    ranks, rack_of, replicas = layout
    if len(set(rack_of.values())) < 2:
        assert "one rack only" in peers.assign_peers(ranks, rack_of, replicas).degraded
        return
    failed = data.draw(st.sampled_from(sorted(set(rack_of.values()))))
    got = peers.assign_peers(ranks, rack_of, replicas)
    for giver, held in got.peers.items():
        survivors = [h for h in (giver, *held) if rack_of[h] != failed]
        assert survivors, f"{giver}'s copies all lived in rack {failed}"


@SETTINGS
@given(st.integers(2, 4), st.integers(1, 6), st.integers(1, 3))
def test_equal_racks_give_every_node_the_same_number_of_copies(
    racks_n: int, per_rack: int, replicas: int
) -> None:
    rack_of = {N(f"r{k}-n{i}"): f"r{k}" for k in range(racks_n) for i in range(per_rack)}
    got = peers.assign_peers({n: [0, 1] for n in rack_of}, rack_of, replicas)
    held = dict.fromkeys(rack_of, 0)
    for holder in (h for hs in got.peers.values() for h in hs):
        held[holder] += 1
    if replicas <= (racks_n - 1) * per_rack:
        assert set(held.values()) == {replicas}
        assert got.degraded == ""
    else:
        assert got.degraded  # too few nodes in other racks, or too few nodes at all


def walked_whole(
    giver: NodeName, ring: list[NodeName], rack_of: dict[NodeName, str], replicas: int
) -> tuple[NodeName, ...]:
    """The rule read literally (the walk of the whole ring that peers._holders stops early)."""
    at = ring.index(giver)
    walk = ring[at + 1 :] + ring[:at]
    away = [n for n in walk if rack_of[n] != rack_of[giver]]
    near = [n for n in walk if rack_of[n] == rack_of[giver]]
    return tuple((away + near)[: max(0, replicas)])


@SETTINGS
@given(layouts(), st.integers(0, 12))
def test_the_walk_that_stops_early_chooses_as_the_whole_walk(
    layout: tuple[dict[NodeName, list[int]], dict[NodeName, str], int], replicas: int
) -> None:
    ranks, rack_of, _ = layout
    ring = peers._ring(set(rack_of), rack_of)
    got = peers.assign_peers(ranks, rack_of, replicas)
    assert got.peers == {g: walked_whole(g, ring, rack_of, replicas) for g in got.peers}
