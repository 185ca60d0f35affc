"""Expert-parallel load balancing (placement.eplb): the redundant slots go to the hottest
experts, the copies are spread so that pods are even too, a skewed load's max/mean per card
falls by at least 30% against the first map (issue 33, item 5), and a map close to the plan
is kept (no flapping)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixpool.placement import eplb
from matrixpool.serving import experts

# The design's decode role: EP320, 288 experts and 32 redundant on 40 pods of 8 cards.
EXPERTS, SLOTS, CARDS_PER_POD = 288, 320, 8


def zipf(experts_: int, skew: float, seed: int = 7, tokens: float = 1e6) -> list[float]:
    """A load of ``tokens`` routed tokens, skewed as the simulated server's gate skews it."""
    return [share * tokens for share in experts.zipf_shares(experts_, skew, seed)]


@pytest.mark.parametrize(
    ("experts_", "slots", "skew"),
    [(EXPERTS, SLOTS, 1.0), (EXPERTS, SLOTS, 0.6), (16, 24, 1.2), (256, 288, 0.8)],
    ids=[
        "EP320 with a Zipf-1 load",
        "EP320 with a milder skew",
        "16 experts on 3 pods",
        "DeepSeek-V3's 256 experts",
    ],
)
def test_a_skewed_load_lowers_max_over_mean_per_card_by_at_least_30_percent(
    experts_: int, slots: int, skew: float
) -> None:
    load = zipf(experts_, skew)
    first = eplb.evaluate(load, eplb.default_layout(experts_, slots), CARDS_PER_POD)
    planned = eplb.plan(load, slots, CARDS_PER_POD)
    assert planned.imbalance <= 0.7 * first.imbalance, (first.imbalance, planned.imbalance)
    assert planned.pod_imbalance <= first.pod_imbalance


def test_the_first_layout_copies_experts_0_onwards() -> None:
    assert eplb.default_layout(4, 7) == (0, 1, 2, 3, 0, 1, 2)


def test_the_redundant_slots_go_to_the_experts_with_the_most_load_per_copy() -> None:
    # Expert 2 takes 60%: it gets copies until its load per copy is below expert 0's.
    assert eplb.replicate([30.0, 10.0, 60.0], 6) == [2, 1, 3]


def test_a_card_holds_its_experts_load_over_that_experts_copies() -> None:
    judged = eplb.evaluate([30.0, 10.0, 60.0], (2, 0, 2, 1, 2, 0), 2)
    assert judged.card_loads == (20.0, 15.0, 20.0, 10.0, 20.0, 15.0)
    assert judged.imbalance == pytest.approx(20.0 / (100 / 6))
    assert judged.pod_imbalance == pytest.approx(35.0 / (100 / 3))


def test_copies_of_one_expert_go_to_different_pods_while_there_are_some() -> None:
    layout = eplb.plan([100.0, 1.0, 1.0, 1.0, 1.0], 8, 2).layout  # expert 0: 4 copies
    pods = [layout[i : i + 2] for i in range(0, 8, 2)]
    assert [Counter(pod)[0] for pod in pods] == [1, 1, 1, 1], pods


def test_no_load_leaves_an_even_imbalance() -> None:
    assert eplb.evaluate([0.0, 0.0], (0, 1, 0, 1), 2).imbalance == 1.0


def test_a_map_close_to_the_plan_is_kept_and_a_skewed_one_is_replaced() -> None:
    load = zipf(EXPERTS, 1.0)
    planned = eplb.plan(load, SLOTS, CARDS_PER_POD)
    drifted = [x * (1.1 if e % 2 else 0.9) for e, x in enumerate(load)]  # ±10% per expert
    assert not eplb.worth_replanning(
        eplb.evaluate(drifted, planned.layout, CARDS_PER_POD),
        eplb.plan(drifted, SLOTS, CARDS_PER_POD),
    )
    first = eplb.evaluate(load, eplb.default_layout(EXPERTS, SLOTS), CARDS_PER_POD)
    assert eplb.worth_replanning(first, planned)


def test_a_layout_must_hold_every_expert_in_exactly_its_slots() -> None:
    assert eplb.valid([0, 1, 1], 2, 3)
    assert not eplb.valid([0, 0, 0], 2, 3)  # expert 1 missing
    assert not eplb.valid([0, 1], 2, 3)  # a slot short
    assert not eplb.valid(None, 2, 3)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n, max_size=n),
            st.integers(0, 12),
            st.sampled_from([1, 2, 4]),
        )
    )
)
def test_a_plan_fills_every_slot_once_holds_every_expert_and_never_does_worse(
    drawn: tuple[list[float], int, int],
) -> None:
    load, extra, cards_per_pod = drawn
    slots = -(-(len(load) + extra) // cards_per_pod) * cards_per_pod  # whole pods
    planned = eplb.plan(load, slots, cards_per_pod)
    assert eplb.valid(planned.layout, len(load), slots)
    first = eplb.evaluate(load, eplb.default_layout(len(load), slots), cards_per_pod)
    assert planned.imbalance <= first.imbalance + 1e-9
    assert (
        eplb.hottest(load, 3)
        == sorted((e for e in range(len(load)) if load[e] > 0), key=lambda e: (-load[e], e))[:3]
    )
