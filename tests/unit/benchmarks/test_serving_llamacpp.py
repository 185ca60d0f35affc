"""benchmarks/serving_llamacpp.py's settled share: the requests due in the first SETTLE_S of a
level higher than the one before are left out, and only those."""

from __future__ import annotations

from benchmarks import serving_llamacpp as bench


def test_only_the_start_of_a_rising_level_is_unsettled() -> None:
    levels, step, settle = bench.LEVELS, bench.STEP_S, bench.SETTLE_S
    rises = [i for i in range(1, len(levels)) if levels[i] > levels[i - 1]]
    assert rises  # the load steps up and bursts
    for i in rises:
        assert bench.rising(i * step)
        assert bench.rising(i * step + settle - 0.01)
        assert not bench.rising(i * step + settle) or settle >= step
    falls = [i for i in range(1, len(levels)) if levels[i] <= levels[i - 1]]
    assert all(not bench.rising(i * step + 0.5) for i in falls)
    assert not bench.rising(0.0)
    assert not bench.rising(len(levels) * step + 1)
