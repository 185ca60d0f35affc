"""Per-replica capacity (serving.capacity): a stated figure stays; busy time measures the rate
itself; otherwise the figure rises only from periods within the SLO and falls from misses at a
loaded rate; the CloudMatrix-Infer figures are only the first guess, and say so."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrixpool.serving import capacity, latency

GUESS = capacity.Figure(10_000.0, capacity.Source.FIRST_GUESS)
TARGET_S = 1.0
UTILISATION = 0.8


def period(rate: float, p90: float | None = 0.5, busy: float | None = None) -> capacity.Period:
    """A period in which a replica processed ``rate`` tokens/s at a p90 of ``p90`` s."""
    return capacity.Period(rate, busy, p90, TARGET_S)


def learned(rate: float, periods: int = 1, measure: str = "latency") -> capacity.Figure:
    how = capacity.Measure.BUSY_TIME if measure == "busy" else capacity.Measure.LATENCY
    return capacity.Figure(rate, capacity.Source.LEARNED, periods, how)


# fmt: off
CASES = [
    ("a rate above the figure within the SLO raises it to that rate",
     GUESS, period(12_000), learned(12_000)),
    ("a rate at the target utilisation within the SLO confirms the figure",
     GUESS, period(8_000), learned(10_000)),
    ("a light load within the SLO tells nothing",
     GUESS, period(2_000), GUESS),
    ("a miss at a loaded rate lowers the figure to that rate",
     GUESS, period(7_000, p90=1.5), learned(7_000)),
    ("a miss at a light rate is not the replicas' doing: nothing changes",
     GUESS, period(3_000, p90=1.5), GUESS),
    ("a miss above the figure lowers nothing",
     GUESS, period(12_000, p90=1.5), GUESS),
    ("no latency measured tells nothing",
     GUESS, period(12_000, p90=None), GUESS),
    ("busy time measures the rate at once",
     GUESS, period(2_000, busy=25_000), learned(25_000, measure="busy")),
    ("busy time is averaged with the periods before",
     learned(20_000, 1, "busy"), period(2_000, busy=30_000), learned(25_000, 2, "busy")),
    ("a figure from busy time is kept through a period without busy time",
     learned(20_000, 3, "busy"), period(30_000), learned(20_000, 3, "busy")),
    ("each period learned from counts",
     learned(12_000, 4), period(13_000), learned(13_000, 5)),
    ("a stated figure stays whatever the readings say",
     capacity.Figure(5_000, capacity.Source.STATED), period(9_000, busy=40_000),
     capacity.Figure(5_000, capacity.Source.STATED)),
]
# fmt: on


@pytest.mark.parametrize(
    ("figure", "seen", "expected"), [pytest.param(*case[1:], id=case[0]) for case in CASES]
)
def test_one_period(
    figure: capacity.Figure, seen: capacity.Period, expected: capacity.Figure
) -> None:
    assert capacity.learn(figure, seen, UTILISATION) == expected


def test_busy_time_averages_over_the_window_then_follows_a_change() -> None:
    figure = GUESS
    for _ in range(10):
        figure = capacity.learn(figure, period(1_000, busy=40_000), UTILISATION)
    assert figure == learned(40_000, 10, "busy")
    figure = capacity.learn(figure, period(1_000, busy=20_000), UTILISATION)
    assert figure.tokens_per_s == pytest.approx(35_000)  # a quarter of the way: WINDOW 4


@given(st.lists(st.tuples(st.floats(1, 1e6), st.floats(0.01, 10)), max_size=30))
def test_from_latency_the_figure_rises_only_to_a_rate_sustained_within_the_slo(
    seen: list[tuple[float, float]],
) -> None:
    figure = GUESS
    for rate, p90 in seen:
        after = capacity.learn(figure, period(rate, p90), UTILISATION)
        if after.tokens_per_s > figure.tokens_per_s:
            assert p90 <= TARGET_S
            assert after.tokens_per_s == rate
        if after.tokens_per_s < figure.tokens_per_s:
            assert p90 > TARGET_S
            assert after.tokens_per_s >= capacity.LOWER_SHARE * figure.tokens_per_s
        figure = after


def test_the_first_guess_is_the_published_figures_and_says_so() -> None:
    guess = capacity.first_guess(prefill_cards=8, decode_cards=16)
    assert guess.prefill.tokens_per_s == latency.PREFILL_TOKENS_PER_S_PER_CARD * 8
    assert guess.decode.tokens_per_s > latency.DECODE_TOKENS_PER_S_PER_CARD * 16 * 0.9
    assert guess.prefill.said == "first guess (CloudMatrix-Infer figures)"
    assert learned(5, 1).said == "learned from latency within the SLO over 1 period"
    assert learned(5, 3, "busy").said == "learned from busy time over 3 periods"
    assert capacity.stated(7, GUESS).said == "stated"
    assert capacity.stated(None, GUESS) == GUESS
