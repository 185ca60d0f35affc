"""Tiers 2 and 3 as files: durable copies, manifests, the commit of the shared tier, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool_recovery import checksum, errors, files, manifest, names


def shard(tmp_path: Path, rank: int) -> tuple[Path, manifest.ShardRecord]:
    source = tmp_path / f"source-{rank}"
    source.write_bytes(bytes([rank]) * 5000)
    return source, manifest.ShardRecord(rank, 5000, checksum.of(source.read_bytes()), "node-a")


def test_a_disk_shard_is_named_by_the_manifest_once_complete(tmp_path: Path) -> None:
    disk = files.DiskTier(tmp_path / "disk", "node-a", keep=2)
    disk.store(*shard(tmp_path, 3), "job", 10, world_size=4)
    record, path = disk.locate("job", 3, 10)
    assert path.read_bytes() == bytes([3]) * 5000
    assert record.checksum == checksum.of(bytes([3]) * 5000)
    with pytest.raises(errors.NotFoundError):
        disk.locate("job", 2, 10)


def test_disk_keeps_the_newest_steps(tmp_path: Path) -> None:
    disk = files.DiskTier(tmp_path / "disk", "node-a", keep=2)
    for step in (10, 20, 30):
        disk.store(*shard(tmp_path, 0), "job", step, world_size=1)
    assert [m.step for m in disk.manifests("job")] == [20, 30]


def test_disk_keeps_a_pinned_step_past_the_keep_count(tmp_path: Path) -> None:
    disk = files.DiskTier(tmp_path / "disk", "node-a", keep=2)
    disk.store(*shard(tmp_path, 0), "job", 10, world_size=1)
    disk.pinned["job"] = 10  # a recovery restores step 10
    for step in (20, 30, 40):
        disk.store(*shard(tmp_path, 0), "job", step, world_size=1)
    assert [m.step for m in disk.manifests("job")] == [10, 30, 40]


def test_the_shared_tier_commits_when_the_last_rank_arrives(tmp_path: Path) -> None:
    store = files.Persistent(f"file://{tmp_path}/ckpt", keep=1)
    assert store.store(*shard(tmp_path, 1), "job", 10, world_size=2) is False
    assert store.manifests("job") == []
    assert store.store(*shard(tmp_path, 0), "job", 10, world_size=2) is True
    [committed] = store.manifests("job")
    assert committed.complete
    assert sorted(committed.shards) == [0, 1]


def test_the_shared_tier_prunes_older_steps_but_not_newer_partial_ones(tmp_path: Path) -> None:
    store = files.Persistent(f"file://{tmp_path}/ckpt", keep=1)
    for step in (10, 20):
        store.store(*shard(tmp_path, 0), "job", step, world_size=1)
    store.store(*shard(tmp_path, 0), "job", 30, world_size=2)  # rank 1 still to come
    steps = sorted(p.name for p in (tmp_path / "ckpt" / "job").iterdir())
    assert steps == [names.step_dir(20), names.step_dir(30)]


@pytest.mark.parametrize("uri", ["s3://bucket/ckpt", "file://host/ckpt", "/no/scheme"])
def test_only_local_file_uris_are_supported(uri: str) -> None:
    with pytest.raises(errors.CheckpointError, match="only file:///path"):
        files.Persistent(uri, keep=1)


def test_a_short_source_is_not_renamed_into_place(tmp_path: Path) -> None:
    source = tmp_path / "short"
    source.write_bytes(b"x" * 10)
    with pytest.raises(errors.IntegrityError):
        files.copy_file(source, 20, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
