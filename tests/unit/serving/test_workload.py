"""A serving load as data: deterministic by seed, arrivals that follow the curve's integral
(bursts only add), lengths within bounds with the stated medians, and a shared-prefix share
whose prefixes are the same token ids."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from matrixpool.serving import workload

HOUR = 3600.0
SHORT = workload.LengthModel(
    prompt=workload.Lognormal(16, 0.5, 1, 64), output=workload.Lognormal(8, 0.5, 1, 32)
)  # small prompts: tests about arrivals need not build thousands of 1k-token prompts


def within_poisson_noise(count: int, mean: float, sigmas: float = 4.0) -> bool:
    """A Poisson count lies within ``sigmas`` standard deviations (sqrt(mean)) of its mean."""
    return abs(count - mean) <= sigmas * math.sqrt(mean)


def day(peak_rps: float, bursts: workload.Bursts | None = None) -> workload.DailyPattern:
    return workload.DailyPattern(peak_rps, bursts=bursts)


# --- determinism and open loop ---------------------------------------------------------------
def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    lengths = workload.LengthModel(
        prompt=workload.Lognormal(64, 0.8, 1, 256), shared_prefix_share=0.5, prefix_tokens=16
    )
    first = workload.generate(day(0.5), lengths, 2 * HOUR, seed=7, start_s=9 * HOUR)
    again = workload.generate(day(0.5), lengths, 2 * HOUR, seed=7, start_s=9 * HOUR)
    other = workload.generate(day(0.5), lengths, 2 * HOUR, seed=8, start_s=9 * HOUR)
    assert first == again
    assert [r.arrival_s for r in first] != [r.arrival_s for r in other]
    assert [r.prompt for r in first[:10]] != [r.prompt for r in other[:10]]
    assert [r.id for r in first] == list(range(len(first)))


def test_arrivals_do_not_depend_on_the_lengths() -> None:
    small = workload.generate(day(1.0), SHORT, HOUR, seed=3)
    shared = workload.LengthModel(
        prompt=workload.Lognormal(32, 1.0, 1, 128), shared_prefix_share=0.9, prefix_tokens=8
    )
    larger = workload.generate(day(1.0), shared, HOUR, seed=3)
    assert [r.arrival_s for r in small] == [r.arrival_s for r in larger]
    assert [r.arrival_s for r in small] == workload.arrival_times(day(1.0), HOUR, seed=3)


def test_arrivals_are_sorted_and_inside_the_window() -> None:
    times = workload.arrival_times(day(2.0, workload.Bursts(30, 60, 2.0)), HOUR, seed=1)
    assert times == sorted(times)
    assert times[0] >= 0
    assert times[-1] < HOUR


def test_the_lazy_requests_are_the_generated_ones() -> None:
    lazy = workload.requests(day(1.0), SHORT, HOUR, seed=5, start_s=12 * HOUR)
    assert list(lazy) == workload.generate(day(1.0), SHORT, HOUR, seed=5, start_s=12 * HOUR)


# --- the daily curve -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hour", "share_of_peak"),
    [
        pytest.param(4.0, 0.15, id="the night is at the trough"),
        pytest.param(11.0, 1.0, id="the morning peak is the peak rate"),
        pytest.param(15.5, 0.15 + 0.85 * 0.9, id="the afternoon peak is 90% of the way up"),
        pytest.param(13.0, 0.15 + 0.85 * math.exp(-0.5), id="a dip between the peaks"),
        pytest.param(33.0, 0.15 + 0.85 * math.exp(-0.5), id="the next day at 09:00 as today"),
    ],
)
def test_the_daily_curve(hour: float, share_of_peak: float) -> None:
    pattern = day(10.0)
    assert pattern.rate(hour * HOUR) == pytest.approx(10.0 * share_of_peak, rel=0.02)
    assert pattern.rate(hour * HOUR) <= pattern.ceiling()


def test_a_bump_wraps_around_midnight() -> None:
    late = workload.Peak(hour=23.0, width_h=1.0, height=1.0)
    assert late.at(1.0) == pytest.approx(late.at(21.0)) == pytest.approx(math.exp(-2.0))


def test_a_days_arrivals_follow_the_curve_every_two_hours() -> None:
    pattern = day(1.0)
    times = workload.arrival_times(pattern, 24 * HOUR, seed=11)
    assert within_poisson_noise(len(times), workload.expected_arrivals(pattern, 24 * HOUR))
    for start in range(0, 24, 2):
        count = sum(start * HOUR <= t < (start + 2) * HOUR for t in times)
        mean = workload.expected_arrivals(pattern, 2 * HOUR, start_s=start * HOUR)
        assert within_poisson_noise(count, mean), f"{start}:00-{start + 2}:00"


def test_a_window_starts_at_its_time_of_day() -> None:
    night = workload.arrival_times(day(2.0), HOUR, seed=4, start_s=3 * HOUR)
    noon = workload.arrival_times(day(2.0), HOUR, seed=4, start_s=11 * HOUR)
    assert within_poisson_noise(len(night), 0.15 * 2.0 * HOUR)
    assert within_poisson_noise(len(noon), workload.expected_arrivals(day(2.0), HOUR, 11 * HOUR))
    assert len(noon) > 4 * len(night)


def test_the_expected_count_of_a_stepped_load_is_exact() -> None:
    steps = workload.step_pattern([1, 3, 0.5], step_seconds=600)
    assert workload.expected_arrivals(steps, 1800) == pytest.approx(600 * 4.5)
    assert workload.expected_arrivals(steps, 2400) == pytest.approx(600 * 5.0)  # the last stays


# --- bursts ----------------------------------------------------------------------------------
def test_bursts_only_add_arrivals_and_as_many_as_expected() -> None:
    bursts = workload.Bursts(per_hour=30, duration_s=20, size=2.0)  # 2 x 2.5 rps = 5 rps extra
    calm = workload.arrival_times(day(2.5), 24 * HOUR, seed=9)
    stormy = workload.arrival_times(day(2.5, bursts), 24 * HOUR, seed=9)
    assert set(calm) < set(stormy)
    extra = len(stormy) - len(calm)
    mean = workload.expected_arrivals(day(2.5, bursts), 24 * HOUR) - (
        workload.expected_arrivals(day(2.5), 24 * HOUR)
    )
    assert mean == pytest.approx(30 * 24 * 20 * 5.0)
    per_burst = 20 * 5.0  # a compound Poisson count: variance = bursts x E[per burst^2]
    sd = math.sqrt(30 * 24 * (per_burst**2 + per_burst))
    assert abs(extra - mean) <= 4 * sd


def test_burst_arrivals_come_in_clusters() -> None:
    bursts = workload.Bursts(per_hour=4, duration_s=30, size=1.0)
    calm = set(workload.arrival_times(day(5.0), 6 * HOUR, seed=2))
    extra = sorted(set(workload.arrival_times(day(5.0, bursts), 6 * HOUR, seed=2)) - calm)
    clusters = 1 + sum(b - a > 30 for a, b in itertools.pairwise(extra))
    assert 0 < clusters <= len(extra) / 20  # about 150 arrivals a burst, not scattered


# --- steps -----------------------------------------------------------------------------------
def test_a_stepped_load_steps_through_its_levels_and_holds_the_last() -> None:
    steps = workload.step_pattern([2, 8, 4], step_seconds=300)
    assert [steps.rate(t) for t in (-1, 0, 299.9, 300, 650, 5000)] == [2, 2, 2, 8, 4, 4]
    times = workload.arrival_times(steps, 900, seed=6)
    for index, level in enumerate((2, 8, 4)):
        count = sum(index * 300 <= t < (index + 1) * 300 for t in times)
        assert within_poisson_noise(count, level * 300), f"step {index}"


def test_a_step_of_zero_sends_nothing() -> None:
    assert workload.arrival_times(workload.step_pattern([0], 60), 600, seed=1) == []
    quiet_then_busy = workload.arrival_times(workload.step_pattern([0, 5], 60), 120, seed=1)
    assert quiet_then_busy
    assert min(quiet_then_busy) >= 60


# --- lengths ---------------------------------------------------------------------------------
def test_conversation_lengths_have_the_stated_medians_and_stay_in_bounds() -> None:
    lengths = workload.LengthModel()
    requests = workload.generate(workload.step_pattern([10], HOUR), lengths, 300, seed=21)
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.output_tokens for r in requests]
    # The sample median of a lognormal: log-standard error about 1.2533 sigma / sqrt(n).
    tolerance = 4 * 1.2533 / math.sqrt(len(requests))
    assert abs(math.log(statistics.median(prompts) / 1020)) <= tolerance * 1.0
    assert abs(math.log(statistics.median(outputs) / 129)) <= tolerance * 0.9
    assert min(prompts) >= 1
    assert max(prompts) <= 8192
    assert min(outputs) >= 1
    assert max(outputs) <= 2048


def test_lengths_are_clipped_to_their_bounds() -> None:
    wide = workload.Lognormal(median=100, sigma=3.0, low=50, high=150)
    lengths = workload.LengthModel(prompt=wide, output=wide)
    requests = workload.generate(workload.step_pattern([10], HOUR), lengths, 100, seed=3)
    for values in ([len(r.prompt) for r in requests], [r.output_tokens for r in requests]):
        assert min(values) == 50
        assert max(values) == 150


def test_token_ids_are_16_bit_and_unrelated_between_requests() -> None:
    requests = workload.generate(workload.step_pattern([5], HOUR), SHORT, 60, seed=8)
    ids = [token for r in requests for token in r.prompt]
    assert min(ids) >= 0
    assert max(ids) <= 65535
    assert len({r.prompt[:4] for r in requests if len(r.prompt) >= 4}) > 0.9 * len(requests)


# --- shared prefixes -------------------------------------------------------------------------
def test_the_shared_prefix_share_and_the_prefixes_are_the_same_tokens() -> None:
    lengths = workload.LengthModel(
        prompt=workload.Lognormal(40, 0.5, 1, 100),
        shared_prefix_share=0.3,
        prefix_count=4,
        prefix_tokens=32,
    )
    requests = workload.generate(workload.step_pattern([10], HOUR), lengths, 400, seed=12)
    shared = [r for r in requests if r.prefix_id is not None]
    share, n = len(shared) / len(requests), len(requests)
    assert abs(share - 0.3) <= 4 * math.sqrt(0.3 * 0.7 / n)
    prefixes = {r.prefix_id: r.prompt[:32] for r in shared}
    assert set(prefixes) == {0, 1, 2, 3}
    assert len(set(prefixes.values())) == 4
    for r in shared:
        assert r.prompt[:32] == prefixes[r.prefix_id]
        assert len(r.prompt) >= 33
    for r in requests:
        if r.prefix_id is None:
            assert r.prompt[:32] not in prefixes.values()


def test_a_prefixed_prompt_keeps_its_drawn_length_when_longer_than_the_prefix() -> None:
    plain = workload.LengthModel(prompt=workload.Lognormal(200, 0.2, 100, 300))
    prefixed = workload.LengthModel(
        prompt=plain.prompt, shared_prefix_share=1.0, prefix_count=1, prefix_tokens=10
    )
    pattern = workload.step_pattern([5], HOUR)
    without = workload.generate(pattern, plain, 60, seed=4)
    with_prefix = workload.generate(pattern, prefixed, 60, seed=4)
    assert [len(r.prompt) for r in without] == [len(r.prompt) for r in with_prefix]
    assert {r.prefix_id for r in with_prefix} == {0}


def test_no_share_means_no_prefixes() -> None:
    requests = workload.generate(workload.step_pattern([5], HOUR), SHORT, 120, seed=4)
    assert all(r.prefix_id is None for r in requests)


# --- parameters out of range -----------------------------------------------------------------
@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: workload.DailyPattern(-1.0), id="a negative peak rate"),
        pytest.param(lambda: workload.DailyPattern(1.0, trough=1.5), id="a trough above 1"),
        pytest.param(lambda: workload.Peak(25.0, 1.0, 1.0), id="an hour past midnight"),
        pytest.param(lambda: workload.Peak(10.0, 0.0, 1.0), id="a bump of no width"),
        pytest.param(lambda: workload.Bursts(duration_s=0), id="a burst of no length"),
        pytest.param(lambda: workload.step_pattern([], 60), id="no steps"),
        pytest.param(lambda: workload.step_pattern([1, -1], 60), id="a negative step"),
        pytest.param(lambda: workload.step_pattern([1], 0), id="steps of no length"),
        pytest.param(lambda: workload.Lognormal(10, 1.0, 20, 30), id="a median below the low"),
        pytest.param(lambda: workload.LengthModel(shared_prefix_share=1.2), id="a share above 1"),
        pytest.param(lambda: workload.LengthModel(prefix_count=0), id="no prefixes"),
    ],
)
def test_parameters_out_of_range_are_refused(build: object) -> None:
    assert callable(build)
    with pytest.raises(ValueError, match="need"):
        build()


def test_a_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="seconds"):
        workload.arrival_times(day(1.0), -1, seed=1)
