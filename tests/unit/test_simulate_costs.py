"""The recovery-time model's rules (matrixpool.simulate.costs), and the baselines expressed
through what policy.decide is shown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from matrixpool.simulate import costs, model, run
from matrixpool_recovery import policy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "simulate"
COSTS = model.load(EXAMPLES / "llama3.yaml").costs


def copies(tier: policy.Tier, ranks: int, node: str | None = "n1") -> dict[int, policy.Copy]:
    holder = None if tier == policy.Tier.PERSISTENT else policy.NodeName(node or "n1")
    return {r: policy.Copy(r, 10, tier, holder) for r in range(ranks)}


def test_restore_time_follows_the_state_per_rank_not_the_number_of_ranks() -> None:
    home = dict.fromkeys(range(2048), "n1")
    few = costs.restore(COSTS, copies(policy.Tier.MEMORY, 8), home, 2.8)
    many = costs.restore(COSTS, copies(policy.Tier.MEMORY, 2048), home, 2.8)
    bigger = costs.restore(COSTS, copies(policy.Tier.MEMORY, 8), home, 5.6)
    assert few == many == pytest.approx(2.8 / COSTS.bandwidth_gbps["memory"])
    assert bigger == pytest.approx(2 * few)


def test_a_copy_on_another_node_is_read_at_the_peer_bandwidth() -> None:
    away = dict.fromkeys(range(8), "n2")
    seconds = costs.restore(COSTS, copies(policy.Tier.MEMORY, 8, "n1"), away, 2.8)
    assert seconds == pytest.approx(2.8 / COSTS.bandwidth_gbps["peers"])


def test_persistent_restores_are_capped_by_the_store_in_aggregate() -> None:
    one = costs.restore(COSTS, copies(policy.Tier.PERSISTENT, 1), {}, 2.8)
    all_ranks = costs.restore(COSTS, copies(policy.Tier.PERSISTENT, 1_000_000), {}, 2.8)
    assert one == pytest.approx(2.8 / COSTS.bandwidth_gbps["persistent"])
    assert all_ranks == pytest.approx(1_000_000 * 2.8 / COSTS.persistent_aggregate_gbps)


@pytest.mark.parametrize(
    ("level", "components", "settle", "start"),
    [
        (policy.Level.IN_PLACE, ["software"], 0.0, COSTS.pod_start_seconds),
        (policy.Level.SPARE_SWAP, ["node"], COSTS.settle_seconds, COSTS.pod_start_seconds),
        (
            policy.Level.RESCHEDULE,
            ["rack"],
            COSTS.settle_seconds,
            COSTS.gang_start_seconds + 2048 / COSTS.bind_pods_per_second,
        ),
    ],
    ids=["InPlace restarts one pod", "SpareSwap waits the settle window", "Reschedule binds all"],
)
def test_time_to_training_again_adds_up_the_parts(
    level: policy.Level, components: list[str], settle: float, start: float
) -> None:
    b = costs.recovery(COSTS, level, components, 2048, 16384, 1.5)
    setup = COSTS.setup_seconds_per_doubling * 14  # log2(16,384)
    assert (b.detect, b.settle, b.start, b.restore) == (
        COSTS.detect_seconds[components[0]],
        settle,
        pytest.approx(start),
        1.5,
    )
    assert b.total == pytest.approx(b.detect + settle + start + 1.5 + setup + COSTS.compile_seconds)


def test_the_baselines_are_what_decide_chooses_when_shown_less() -> None:
    config = model.load(EXAMPLES / "llama3.yaml")
    headline = dataclasses.replace(config.jobs[0], cards=(256, 256))
    components = {
        k: dataclasses.replace(c, count=c.count * 200)
        for k, c in config.failures.components.items()
    }
    small = dataclasses.replace(
        config,
        horizon_days=5,
        cluster=dataclasses.replace(config.cluster, supernodes=2),
        jobs=(headline,),
        inference=model.Inference(None, 64, 1000),
        failures=dataclasses.replace(config.failures, components=components),
        probe_cards=0,
    )
    levels = {o.policy: {r.level for r in o.recoveries} for o in run.simulate(small)}
    assert levels["job_restart"] == {"Reschedule"}
    assert "SpareSwap" not in levels["no_spares"]
    assert {"InPlace", "SpareSwap"} <= levels["matrixpool"]
