"""The recovery-time model's rules (matrixpool.simulate.costs), and the baselines expressed
through what policy.decide is shown."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from matrixpool.simulate import costs, model, run
from matrixpool_recovery import policy

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "simulate"
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


def test_blocking_saves_keep_the_interval_over_the_interval_plus_the_write() -> None:
    """Rule 5: the job trains ``interval / (interval + write)`` of its time; writes are priced
    as reads of the same tier, so the store's aggregate cap applies to wide jobs."""
    write = costs.save(COSTS, "persistent", 2048, 2.8)
    assert write == pytest.approx(2.8 / COSTS.bandwidth_gbps["persistent"])
    assert costs.useful_fraction(1800, write) == pytest.approx(1800 / (1800 + write))
    wide = costs.save(COSTS, "persistent", 1_000_000, 2.8)
    assert wide == pytest.approx(1_000_000 * 2.8 / COSTS.persistent_aggregate_gbps)


def test_a_blocking_policy_loses_its_writes_and_its_late_detection() -> None:
    """The same faults and job under job_restart, once as built and once with blocking saves
    and Kubernetes' eviction delay for node losses: the headline job loses exactly the
    stalls' share of its training, and every node-loss recovery starts 350 s later."""
    config = model.load(EXAMPLES / "llama3.yaml")
    headline = next(j for j in config.jobs if j.headline)
    plain = dataclasses.replace(model.BUILTIN_POLICIES["job_restart"], persistent_every_steps=300)
    slow = dataclasses.replace(plain, blocking_saves=True, detect_seconds={"node": 350.0})
    small = dataclasses.replace(
        config,
        horizon_days=5,
        cluster=dataclasses.replace(config.cluster, supernodes=6),
        jobs=(dataclasses.replace(headline, cards=(2048, 2048)),),
        inference=model.Inference(None, 64, 1000),
        failures=dataclasses.replace(
            config.failures,
            components={
                k: dataclasses.replace(c, count=c.count * 20)
                for k, c in config.failures.components.items()
                if k in ("node", "software")
            },
        ),
        probe_cards=0,
    )
    before, after = run.simulate(small, (plain, slow))
    assert before.faults == after.faults > 5
    fraction = costs.useful_fraction(300 * 6, costs.save(COSTS, "persistent", 256, 2.8))
    assert after.headline is not None
    assert before.headline is not None
    assert after.headline.rate == pytest.approx(fraction)
    assert before.headline.rate == 1.0
    node_before = [r.breakdown.detect for r in before.recoveries if r.breakdown.settle]
    node_after = [r.breakdown.detect for r in after.recoveries if r.breakdown.settle]
    assert node_before
    assert set(node_before) == {COSTS.detect_seconds["node"]}
    assert set(node_after) == {350.0}
    assert after.headline.progress < before.headline.progress
