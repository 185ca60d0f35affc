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
