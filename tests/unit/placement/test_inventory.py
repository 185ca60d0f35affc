"""The pure card inventory: selectors, card lists, spares and the pool summary."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrixpool.placement import inventory

CARDS = "huawei.com/Ascend910"


def node(
    name: str,
    *,
    ready: bool = True,
    cards: int = 8,
    unhealthy: frozenset[int] = frozenset(),
    **labels: str,
) -> inventory.NodeInfo:
    return inventory.NodeInfo(
        inventory.NodeName(name), {"sn": "a", **labels}, ready, {CARDS: cards}, unhealthy
    )


@pytest.mark.parametrize(
    ("spec", "labels", "expected"),
    [
        pytest.param({"matchLabels": {"sn": "a"}}, {"sn": "a"}, True, id="matchLabels equal"),
        pytest.param({"matchLabels": {"sn": "a"}}, {"sn": "b"}, False, id="matchLabels differ"),
        pytest.param({}, {"sn": "a"}, False, id="an empty selector selects nothing"),
        pytest.param(
            {"matchExpressions": [{"key": "sn", "operator": "In", "values": ["a", "b"]}]},
            {"sn": "b"},
            True,
            id="In matches a listed value",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "sn", "operator": "NotIn", "values": ["a"]}]},
            {},
            True,
            id="NotIn matches a missing key",
        ),
        pytest.param(
            {"matchExpressions": [{"key": "sn", "operator": "Exists"}]},
            {},
            False,
            id="Exists needs the key",
        ),
        pytest.param(
            {
                "matchExpressions": [{"key": "x", "operator": "DoesNotExist"}],
                "matchLabels": {"sn": "a"},
            },
            {"sn": "a"},
            True,
            id="DoesNotExist and matchLabels together",
        ),
    ],
)
def test_selector(spec: dict[str, object], labels: dict[str, str], expected: bool) -> None:
    assert inventory.Selector.from_spec(spec).matches(labels) is expected


@pytest.mark.parametrize(
    ("text", "cards", "bad"),
    [
        pytest.param("3,5", {3, 5}, [], id="two cards"),
        pytest.param("", set(), [], id="empty heals"),
        pytest.param(None, set(), [], id="absent"),
        pytest.param(" 1 , 1 ,x", {1}, ["x"], id="duplicates fold and junk is reported"),
    ],
)
def test_parse_card_list(text: str | None, cards: set[int], bad: list[str]) -> None:
    assert inventory.parse_card_list(text) == (frozenset(cards), bad)


def test_summary_of_a_healthy_supernode_holds_back_whole_spare_nodes() -> None:
    nodes = [node(f"n{i:02d}") for i in range(48)]
    summary = inventory.summarize(nodes, CARDS, {}, spares=1)
    assert (summary.cards_total, summary.cards_allocatable, summary.cards_spare) == (384, 376, 8)
    assert summary.spare_nodes == ("n47",)


def test_faulty_nodes_and_cards_are_unhealthy_and_never_spares() -> None:
    nodes = [node("n0"), node("n1", unhealthy=frozenset({3, 5, 99})), node("n2", ready=False)]
    summary = inventory.summarize(nodes, CARDS, {}, spares=2)
    assert summary.cards_unhealthy == 2 + 8  # index 99 does not exist on an 8-card node
    assert summary.spare_nodes == ("n0",)
    assert summary.nodes_ready == 2
    assert summary.cards_allocatable == 24 - 10 - 8


def test_busy_nodes_are_not_chosen_as_spares() -> None:
    nodes = [node("n0"), node("n1")]
    summary = inventory.summarize(nodes, CARDS, {inventory.NodeName("n1"): 4}, spares=1)
    assert summary.spare_nodes == ("n0",)
    assert summary.cards_allocated == 4


@given(
    st.lists(
        st.tuples(st.booleans(), st.frozensets(st.integers(0, 9), max_size=4)),
        min_size=0,
        max_size=20,
    ),
    st.integers(0, 5),
)
def test_card_counts_always_add_up(facts: list[tuple[bool, frozenset[int]]], spares: int) -> None:
    nodes = [node(f"n{i:02d}", ready=r, unhealthy=u) for i, (r, u) in enumerate(facts)]
    summary = inventory.summarize(nodes, CARDS, {}, spares)
    assert summary.cards_total == 8 * len(nodes)
    assert summary.cards_allocatable + summary.cards_unhealthy + summary.cards_spare == (
        summary.cards_total
    )
    assert summary.cards_allocatable >= 0
    assert len(summary.spare_nodes) <= spares
