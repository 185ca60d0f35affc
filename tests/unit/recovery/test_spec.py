"""Which tiers a save reaches, from the TrainingJob's checkpoint spec."""

from __future__ import annotations

import pytest

from matrixpool_recovery.spec import CheckpointSpec

JOB_SPEC = {
    "memory": {"everySteps": 10, "peerReplicas": 2},
    "local": {"everySteps": 100},
    "persistent": {"everySteps": 1000, "uri": "file:///mnt/ckpt/llm"},
}


@pytest.mark.parametrize(
    ("step", "tiers"),
    [
        pytest.param(5, (), id="a step due nowhere"),
        pytest.param(10, ("memory",), id="every 10 steps to memory"),
        pytest.param(100, ("memory", "local"), id="every 100 to local disk too"),
        pytest.param(3000, ("memory", "local", "persistent"), id="every 1000 to every tier"),
    ],
)
def test_the_cadence_of_each_tier_follows_the_job_spec(step: int, tiers: tuple[str, ...]) -> None:
    assert CheckpointSpec.from_job(JOB_SPEC).due(step) == tiers


def test_the_job_spec_is_read_in_its_api_spelling() -> None:
    spec = CheckpointSpec.from_job(JOB_SPEC)
    assert (spec.memory_every, spec.peer_replicas, spec.local_every) == (10, 2, 100)
    assert (spec.persistent_every, spec.persistent_uri) == (1000, "file:///mnt/ckpt/llm")


def test_absent_tiers_are_never_due() -> None:
    spec = CheckpointSpec.from_json('{"local": {"everySteps": 5}}')
    assert spec.due(10) == ("local",)
    assert spec.peer_replicas == 0


def test_persistent_without_a_uri_is_never_due() -> None:
    assert CheckpointSpec(memory_every=None, persistent_every=1).due(1) == ()
