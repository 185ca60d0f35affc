"""Card choice inside one node: card groups, best fit, whole groups, capacity."""

from __future__ import annotations

import pytest

from matrixpool.placement import cards

TWO_RINGS = cards.shape_of(8, [range(4), range(4, 8)])
ONE_GROUP = cards.shape_of(8, [])


def free(*ids: int) -> int:
    return cards.mask_of(ids)


@pytest.mark.parametrize(
    ("shape", "free_cards", "size", "taken"),
    [
        pytest.param(TWO_RINGS, range(8), 4, [0, 1, 2, 3], id="a request of 4 stays in one group"),
        pytest.param(
            TWO_RINGS, [1, 2, 3, 4, 5], 4, [], id="4 free cards split over two groups hold no 4"
        ),
        pytest.param(
            TWO_RINGS,
            [1, 2, 3, 4, 5, 6, 7],
            2,
            [1, 2],
            id="a small request takes the group with the fewest free cards (best fit)",
        ),
        pytest.param(
            TWO_RINGS, range(8), 8, list(range(8)), id="a request of a whole node takes both groups"
        ),
        pytest.param(
            TWO_RINGS, [0, 1, 2, 3, 4, 5, 6], 8, [], id="a whole-node request needs every card free"
        ),
        pytest.param(
            TWO_RINGS, range(8), 6, [], id="a request above a group but not a multiple never fits"
        ),
        pytest.param(ONE_GROUP, [0, 3, 5, 7], 3, [0, 3, 5], id="without groups any free cards do"),
        pytest.param(
            cards.shape_of(8, [range(4)]),
            range(8),
            4,
            [0, 1, 2, 3],
            id="cards no group names form one more group",
        ),
    ],
)
def test_fitter_takes(shape: cards.Shape, free_cards: range, size: int, taken: list[int]) -> None:
    assert cards.fitter(shape).take(free(*free_cards), size) == free(*taken)


@pytest.mark.parametrize(
    ("free_cards", "size", "pods"),
    [
        pytest.param(range(8), 1, 8, id="eight single cards"),
        pytest.param(range(8), 3, 2, id="one pod of 3 per group"),
        pytest.param([0, 1, 2, 4, 5, 6], 4, 0, id="no whole group left for a 4"),
        pytest.param(range(8), 8, 1, id="one whole node"),
    ],
)
def test_fitter_capacity(free_cards: range, size: int, pods: int) -> None:
    assert cards.fitter(TWO_RINGS).capacity(free(*free_cards), size) == pods


def test_cards_of_lists_the_set_bits_ascending() -> None:
    assert cards.cards_of(0b1010_0101) == (0, 2, 5, 7)
    assert cards.lowest(0b1010_0101, 3) == 0b0010_0101
