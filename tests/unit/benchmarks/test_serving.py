"""benchmarks/serving.py at a small scale (a day in two simulated minutes, a few thousand
requests): the three policies serve every request, the fixed size holds the most cards, the
autoscaler stays inside the night window's cap, and the pool moves bytes and finds prefixes."""

from __future__ import annotations

import pytest

from benchmarks import serving
from matrixpool.serving import workload


def test_every_policy_serves_every_request_and_the_autoscaler_holds_fewer_cards() -> None:
    factor = 3600 / 5  # an hour of the curve in 5 s
    day = workload.DailyPattern(peak_rps=40.0)
    asks = serving.day_of_requests(serving.Compressed(day, factor), workload.DAY_S / factor, 3)
    top = serving.peak_sizing(day, asks)
    outcomes = {
        name: serving.simulate(policy, asks, workload.DAY_S / factor, factor)
        for name, policy in (
            ("fixed", serving.fixed(top)),
            ("window", serving.windowed(top, factor)),
            ("autoscaler", serving.autoscaled(top, factor)),
        )
    }
    assert all(o.failed == 0 for o in outcomes.values())
    assert outcomes["autoscaler"].card_hours < outcomes["fixed"].card_hours
    assert outcomes["window"].card_hours <= outcomes["fixed"].card_hours
    night = [r for r in outcomes["autoscaler"].replicas if r[0] < 8 or r[0] >= 22]
    assert night
    assert all(p * serving.PREFILL_CARDS + d * serving.DECODE_CARDS <= 64 for _, p, d in night)


def test_the_pool_finds_shared_prefixes_and_cuts_the_time_to_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serving, "PREFIX_SECONDS", 20.0)
    figures = serving.prefix_figures(seed=1)
    assert figures["hit_rate"] > 0.5
    assert figures["bytes_moved"] > 0
    assert figures["ttft_p50_pool_s"] < figures["ttft_p50_nopool_s"]
