"""Properties of the simulator: deterministic for a seed, more failures never help, the
engine never holds a card twice, the report's shape."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import Counter
from pathlib import Path

import pytest

from matrixpool import cli
from matrixpool.simulate import model, report, run

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "simulate"


def small(seed: int = 1, scale: float = 1.0, **changes: object) -> model.Config:
    """Two supernodes, a 256-card headline job and a few small ones, 10 days, failure rates
    a hundred times Llama 3's per card (so a small pool sees dozens of faults)."""
    config = model.load(EXAMPLES / "llama3.yaml")
    headline = dataclasses.replace(config.jobs[0], cards=(256, 256))
    others = dataclasses.replace(
        config.jobs[3], count=12, cards=(8, 64), hours=(5, 40), start_hours=(0, 200)
    )
    components = {
        k: dataclasses.replace(c, count=c.count * 100 * scale)
        for k, c in config.failures.components.items()
    }
    base = dataclasses.replace(
        config,
        seed=seed,
        horizon_days=10,
        cluster=dataclasses.replace(config.cluster, supernodes=2),
        jobs=(headline, others),
        failures=dataclasses.replace(config.failures, components=components),
        probe_cards=0,
    )
    return dataclasses.replace(base, **changes)


def test_a_run_is_deterministic_for_a_seed() -> None:
    first = report.figures(small(seed=3), run.simulate(small(seed=3)))
    again = report.figures(small(seed=3), run.simulate(small(seed=3)))
    other = report.figures(small(seed=4), run.simulate(small(seed=4)))
    assert first == again
    assert first["recoveries"] != other["recoveries"]


def test_more_failures_never_raise_goodput() -> None:
    def mean_goodput(scale: float) -> float:
        chosen = (model.BUILTIN_POLICIES["matrixpool"],)
        return statistics.fmean(
            report.goodput(run.simulate(small(seed, scale), chosen)[0]) for seed in (1, 2, 3)
        )

    fewer, more, most = mean_goodput(0.5), mean_goodput(2), mean_goodput(8)
    assert fewer >= more >= most
    assert most < fewer  # the failures do cost something


def test_the_engine_never_holds_a_card_twice_and_jobs_hold_what_they_think() -> None:
    config = small(seed=2, scale=4)
    for chosen in config.policies:
        simulation = run.Run(config, chosen, run.failures.trace(config))
        outcome = simulation.run()
        held = Counter((h.node, c) for h in simulation.pool.snapshot.holdings() for c in h.cards)
        assert max(held.values()) == 1, chosen.name
        for node, card in held:
            assert card not in simulation.pool.free_cards(node)
        for job in outcome.jobs:
            mine = {(n, c) for r, n in job.node_of.items() for c in job.cards_of[r]}
            assert all(held[k] == 1 for k in mine), job.key
        assert outcome.faults > 20


def test_policies_rank_as_their_means_allow() -> None:
    config = small(seed=5, scale=2)
    goodput = report.figures(config, run.simulate(config))["goodput"]
    assert goodput["matrixpool"] > goodput["job_restart"]
    assert goodput["matrixpool"] >= goodput["no_peer_copies"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["jobs"][0].update(cards=0), "jobs[0].cards"),
        (lambda d: d["cluster"].update(cardz=8), "cluster.cardz: unknown field"),
        (
            lambda d: d["costs"]["bandwidth_gbps"].pop("peers"),
            "costs.bandwidth_gbps.peers: missing",
        ),
        (lambda d: d.update(policies=["matrixpool", "magic"]), "policies[1]: unknown policy"),
        (
            lambda d: d["failures"]["components"]["card"].update(count="often"),
            "failures.components.card.count",
        ),
        (lambda d: d["inference"]["windows"].pop(), "inference.windows"),
        (lambda d: d["jobs"][1].update(hours=[5, 1]), "jobs[1].hours: high"),
        (
            lambda d: d["policy_overrides"]["job_restart"].update(detect_seconds={"disk": 1}),
            "policy_overrides.job_restart.detect_seconds.disk: expected one of",
        ),
        (
            lambda d: d["policy_overrides"]["job_restart"].update(blocking_saves="yes"),
            "policy_overrides.job_restart.blocking_saves: expected true or false",
        ),
    ],
    ids=[
        "zero cards",
        "unknown field",
        "missing bandwidth",
        "unknown policy",
        "rate not a number",
        "windows do not cover the day",
        "hours range reversed",
        "unknown component to detect",
        "blocking_saves not a boolean",
    ],
)
def test_bad_yaml_gets_an_error_naming_the_field(change: object, field: str) -> None:
    import yaml

    data = yaml.safe_load((EXAMPLES / "llama3.yaml").read_text())
    change(data)  # type: ignore[operator]
    with pytest.raises(model.ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        model.parse(data)


def test_the_command_prints_the_json_object_last(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", str(EXAMPLES / "recovery-384.yaml"), "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    figures = json.loads(last)
    assert set(figures["goodput"]) == {"matrixpool"}
    assert figures["recoveries"]["matrixpool"]["InPlace"]["count"] == 1


def test_the_trace_follows_the_rates_and_a_rack_fault_takes_a_whole_rack() -> None:
    config = small(seed=7)
    trace = run.failures.trace(config)
    cluster = config.cluster
    hours = config.horizon_days * 24
    for component in model.COMPONENTS:
        expected = config.failures.per_card_hour(component) * cluster.cards * hours
        seen = sum(1 for f in trace if f.component == component)
        assert abs(seen - expected) <= 4 * expected**0.5 + 1, component
    racks = [f for f in trace if f.component == "rack"]
    assert racks
    for fault in racks:
        assert len(fault.nodes) == cluster.nodes_per_rack
        first = fault.nodes[0]
        assert first % cluster.nodes_per_rack == 0
        assert fault.nodes == tuple(range(first, first + cluster.nodes_per_rack))
    assert trace == sorted(trace)
