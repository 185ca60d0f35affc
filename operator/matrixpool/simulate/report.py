"""Figures of a simulated run: the JSON object ``matrixpool simulate --json`` prints last, and
the PNG plots (goodput over time per policy, recovery-time CDF).

Called by the CLI and ``benchmarks/goodput.py`` with the :class:`run.Outcome` of each policy.
Goodput is the headline job's useful training seconds kept over its wall seconds (arrival to
done, or to the horizon); ``mix_goodput`` is the same over every training job's card-seconds
(useful card-seconds kept over card-seconds held, recoveries and restarts included).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matrixpool.simulate import model, run

LEVELS = ("InPlace", "SpareSwap", "Reschedule")


def execute(
    config: model.Config, plot_dir: Path | None = None, *, progress: bool = False
) -> dict[str, Any]:
    """Every policy's run, the recovery probe when ``probe_cards`` is set, the plots; the
    report with the wall seconds each part took."""
    started = time.perf_counter()
    outcomes = []
    for chosen in config.policies:
        outcomes.append(run.simulate(config, (chosen,))[0])
        if progress:
            print(f"{chosen.name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    simulated = time.perf_counter() - started
    probed = run.probe(config, config.probe_cards) if config.probe_cards else None
    result = figures(config, outcomes, probed)
    if plot_dir is not None:
        result["plots"] = [str(p) for p in plots(outcomes, plot_dir)]
    result["wall_seconds"] = {
        "policies": round(simulated, 1),
        "total": round(time.perf_counter() - started, 1),
    }
    return result


def figures(
    config: model.Config,
    outcomes: Sequence[run.Outcome],
    probe: Mapping[str, run.Recovery] | None = None,
) -> dict[str, Any]:
    """The report as one JSON-ready object."""
    result: dict[str, Any] = {
        "config": model.as_dict(config),
        "goodput": {o.policy: round(goodput(o), 4) for o in outcomes},
        "mix_goodput": {o.policy: round(mix_goodput(o), 4) for o in outcomes},
        "lost_steps": {o.policy: _headline_lost(o) for o in outcomes},
        "recoveries": {o.policy: recovery_stats(o) for o in outcomes},
        "utilisation": {o.policy: utilisation(o) for o in outcomes},
        "faults": max((o.faults for o in outcomes), default=0),
        "failed_decisions": {o.policy: o.failed for o in outcomes},
    }
    if probe is not None:
        result["recovery_minutes_10k"] = {k: round(r.seconds / 60, 2) for k, r in probe.items()}
        result["recovery_10k_breakdown_s"] = {
            k: {p: round(getattr(r.breakdown, p), 2) for p in _PARTS} for k, r in probe.items()
        }
        result["probe_cards"] = next((r.cards for r in probe.values()), 0)
    return result


_PARTS = ("detect", "settle", "start", "restore", "setup", "compile")


def goodput(outcome: run.Outcome) -> float:
    job = outcome.headline
    if job is None:
        return 0.0
    end = job.done_at if job.done_at is not None else outcome.horizon
    wall = end - job.arrival
    return job.progress / wall if wall > 0 else 0.0


def mix_goodput(outcome: run.Outcome) -> float:
    held = sum(j.held_card_seconds for j in outcome.jobs)
    useful = sum(j.progress * j.cards for j in outcome.jobs)
    return useful / held if held else 0.0


def _headline_lost(outcome: run.Outcome) -> int:
    job = outcome.headline
    return job.lost_steps if job is not None else 0


def recovery_stats(outcome: run.Outcome) -> dict[str, dict[str, float]]:
    """Per level: count, p50, p90 and max seconds from the first fault to training again."""
    stats: dict[str, dict[str, float]] = {}
    for level in sorted({r.level for r in outcome.recoveries}):
        seconds = sorted(r.seconds for r in outcome.recoveries if r.level == level)
        stats[level] = {
            "count": len(seconds),
            "p50_s": round(_quantile(seconds, 0.5), 1),
            "p90_s": round(_quantile(seconds, 0.9), 1),
            "max_s": round(seconds[-1], 1),
            "lost_steps": sum(r.lost_steps for r in outcome.recoveries if r.level == level),
        }
    return stats


def _quantile(values: Sequence[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def utilisation(outcome: run.Outcome) -> dict[str, float]:
    """Card-seconds held by training, by inference and training usefully, over all cards."""
    total = outcome.card_seconds["total"] or 1.0
    return {
        k: round(outcome.card_seconds[k] / total, 4) for k in ("training", "inference", "useful")
    }


def plots(outcomes: Sequence[run.Outcome], directory: Path) -> list[Path]:
    """goodput.png and recovery-cdf.png in ``directory``; matplotlib is the bench extra."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    directory.mkdir(parents=True, exist_ok=True)
    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    for o in outcomes:
        if o.samples:
            axes.plot([h / 24 for h, _ in o.samples], [g for _, g in o.samples], label=o.policy)
    axes.set_xlabel("day")
    axes.set_ylabel("headline job goodput so far")
    axes.set_title("Goodput over time (simulated)")
    axes.grid(alpha=0.3)
    axes.legend()
    goodput_png = directory / "goodput.png"
    figure.tight_layout()
    figure.savefig(goodput_png, dpi=110)
    pyplot.close(figure)
    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    for o in outcomes:
        seconds = sorted(r.seconds for r in o.recoveries if r.level in LEVELS and r.seconds > 0)
        if seconds:
            share = [(k + 1) / len(seconds) for k in range(len(seconds))]
            axes.step([s / 60 for s in seconds], share, where="post", label=o.policy)
    axes.set_xscale("log")
    axes.set_xlabel("minutes from fault to training again")
    axes.set_ylabel("share of recoveries")
    axes.set_title("Recovery time CDF, every job of the mix (simulated)")
    axes.grid(alpha=0.3)
    axes.legend()
    cdf_png = directory / "recovery-cdf.png"
    figure.tight_layout()
    figure.savefig(cdf_png, dpi=110)
    pyplot.close(figure)
    return [goodput_png, cdf_png]
