"""benchmarks/scale.py's reading of the operator's histograms (the rest runs a cluster)."""

from __future__ import annotations

from benchmarks import scale


def histogram(metric: str, counts: dict[float, float], total: float) -> scale.Samples:
    """Cumulative buckets ``{le: count}`` of ``metric``, with its _count and _sum."""
    samples: scale.Samples = {
        (f"{metric}_bucket", frozenset({("le", str(le))})): n for le, n in counts.items()
    }
    samples[(f"{metric}_count", frozenset())] = max(counts.values())
    samples[(f"{metric}_sum", frozenset())] = total
    return samples


def test_the_binding_cycle_is_read_apart_from_the_scheduling_cycle() -> None:
    decided = histogram(scale.CYCLE, {0.005: 0, 0.01: 8, 1.0: 10, float("inf"): 10}, 0.2)
    binding = histogram(scale.BINDING, {0.5: 0, 1.0: 1, 2.0: 4, float("inf"): 4}, 5.6)
    before: scale.Samples = {}
    after = {**decided, **binding}
    cycles = scale.cycle_figures(before, after, 10.0)
    binds = scale.cycle_figures(before, after, 10.0, scale.BINDING)
    assert (cycles["count"], cycles["share_within_1s"]) == (10, 1.0)
    assert (binds["count"], binds["share_within_1s"]) == (4, 0.25)
    assert binds["mean_s"] == 1.4
    assert 1.0 < binds["p50_s"] < binds["p99_s"] <= 2.0
    assert cycles["p99_s"] is not None
    assert cycles["p99_s"] <= 1.0


def test_issue34_goals_read_the_largest_scale_against_the_smallest() -> None:
    low = {"detect_s": 0.02, "detect_after_shown_s": 0.01}
    high = {
        "cycles": {"submission": {"share_within_1s": 0.7333}},
        "binding_p99_s": {"submission": 1.9883},
        "detect_s": 0.094,
        "detect_after_shown_s": 0.014,
    }
    goals = scale.issue34_goals(low, high)
    assert goals["cycle_p99_submission_within_1s"] is False
    assert goals["binding_p99_submission_within_2s"] is True
    assert goals["detect_s_growth"] == 4.7
    assert goals["detect_s_within_1.5x"] is False
    assert goals["detect_after_shown_s_growth"] == 1.4
    assert goals["detect_after_shown_s_within_1.5x"] is True
    at_once = scale.issue34_goals({"detect_after_shown_s": -0.001}, {"detect_after_shown_s": 0.012})
    assert at_once["detect_after_shown_s_growth"] == 1.2  # against the 10 ms floor
    missing = scale.issue34_goals({}, {})
    assert missing["detect_s_growth"] is None
    assert missing["detect_s_within_1.5x"] is False
    assert missing["binding_p99_submission_within_2s"] is False
