"""Manifests and the commit rule: a step counts only when every rank's shard is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool_recovery import errors, manifest
from matrixpool_recovery.manifest import Holding


def held(rank: int, step: int, tier: str = "memory", node: str = "a") -> Holding:
    return Holding("job", rank, step, tier, 100, "xxh3_64:00", node)


def test_a_manifest_round_trips_and_replaces_atomically(tmp_path: Path) -> None:
    built = manifest.Manifest("job", 10, "local", 2, "node-a")
    built = built.with_shard(manifest.ShardRecord(1, 4096, "xxh3_64:ab", "node-a"))
    manifest.save(tmp_path, built)
    manifest.save(tmp_path, built.with_shard(manifest.ShardRecord(0, 4096, "xxh3_64:cd")))
    loaded = manifest.load(tmp_path)
    assert loaded is not None
    assert loaded.complete
    assert set(loaded.shards) == {0, 1}
    assert [p.name for p in tmp_path.iterdir()] == [manifest.FILE]  # no temporary left


def test_no_manifest_means_nothing_committed(tmp_path: Path) -> None:
    assert manifest.load(tmp_path) is None


def test_a_torn_manifest_is_an_integrity_error(tmp_path: Path) -> None:
    (tmp_path / manifest.FILE).write_text('{"job": "job", "step": 1')
    with pytest.raises(errors.IntegrityError):
        manifest.load(tmp_path)


@pytest.mark.parametrize(
    ("found", "tier", "newest"),
    [
        pytest.param([held(0, 10), held(1, 10)], None, 10, id="every rank on one node"),
        pytest.param(
            [held(0, 10, node="a"), held(1, 10, node="b")], None, 10, id="ranks on two nodes"
        ),
        pytest.param([held(0, 20), held(0, 10), held(1, 10)], None, 10, id="a newer partial step"),
        pytest.param([held(0, 10)], None, None, id="a missing rank"),
        pytest.param(
            [held(0, 10, "memory"), held(1, 10, "local")], None, 10, id="ranks on different tiers"
        ),
        pytest.param(
            [held(0, 10, "memory"), held(1, 10, "local")], "memory", None, id="one tier at a time"
        ),
    ],
)
def test_the_newest_step_complete_for_every_rank(
    found: list[Holding], tier: str | None, newest: int | None
) -> None:
    assert manifest.newest_complete(found, 2, tier) == newest


def test_committed_steps_per_tier_as_status_shows_them() -> None:
    found = [held(0, 20), held(1, 20), held(0, 10, "local"), held(1, 10, "local")]
    assert manifest.committed(found, 2, ["memory", "local", "persistent"]) == {
        "memory": 20,
        "local": 10,
        "persistent": None,
    }
