"""Tiers 2 and 3 as files: durable copies, manifests, the commit of the shared tier, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool_recovery import checksum, errors, files, manifest, names
from tests import tmpfs


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short"]  # no temporary file either


def test_a_copy_that_does_not_read_back_as_its_checksum_is_not_renamed(tmp_path: Path) -> None:
    source, record = shard(tmp_path, 1)
    with pytest.raises(errors.IntegrityError, match="read back"):
        files.copy_file(source, record.size, tmp_path / "dest", checksum.of(b"other bytes"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source-1"]


def test_a_late_write_never_replaces_a_committed_disk_shard(tmp_path: Path) -> None:
    disk = files.DiskTier(tmp_path / "disk", "node-a", keep=2)
    disk.store(*shard(tmp_path, 0), "job", 10, world_size=1)
    late = tmp_path / "late"
    late.write_bytes(b"x" * 5000)
    record = manifest.ShardRecord(0, 5000, checksum.of(late.read_bytes()), "node-a")
    with pytest.raises(errors.IntegrityError, match="refused"):
        disk.store(late, record, "job", 10, world_size=1)
    disk.store(*shard(tmp_path, 0), "job", 10, world_size=1)  # the same shard again: stored
    _, path = disk.locate("job", 0, 10)
    assert path.read_bytes() == bytes([0]) * 5000
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_a_late_write_never_replaces_a_shared_tier_shard(tmp_path: Path) -> None:
    store = files.Persistent(f"file://{tmp_path}/ckpt", keep=2)
    assert store.store(*shard(tmp_path, 0), "job", 10, world_size=1) is True
    late = tmp_path / "late"
    late.write_bytes(b"x" * 5000)
    record = manifest.ShardRecord(0, 5000, checksum.of(late.read_bytes()), "node-b")
    with pytest.raises(errors.IntegrityError, match="refused"):
        store.store(late, record, "job", 10, world_size=1)
    _, path = store.locate("job", 0, 10)
    assert path.read_bytes() == bytes([0]) * 5000


def test_a_failed_manifest_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # a directory where the file should go: the rename fails
    with pytest.raises(IsADirectoryError):
        manifest.write_atomic(tmp_path / "taken", b"{}")
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_a_full_disk_fails_the_save_leaves_nothing_and_recovers(tmp_path: Path) -> None:
    with tmpfs.mounted(tmp_path / "disk", "1m") as mount:
        disk = files.DiskTier(mount, "node-a", keep=2)
        filler = tmpfs.fill(mount)
        with pytest.raises(OSError, match="No space left"):
            disk.store(*shard(tmp_path, 0), "job", 10, world_size=1)
        assert [p for p in mount.rglob("*") if p.name.endswith(".tmp")] == []
        filler.unlink()
        disk.store(*shard(tmp_path, 0), "job", 10, world_size=1)
        assert [m.step for m in disk.manifests("job")] == [10]
