"""Tier 1 of the daemon: bounded memory, recycled buffers, eviction order, restart."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from matrixpool_recovery import checksum, daemon, errors, files, manifest, memory
from tests import tmpfs

SIZE = 4096


def tier(root: Path, limit_shards: int = 4, keep: int = 10) -> memory.MemoryTier:
    return memory.MemoryTier(root, "node-a", limit_shards * SIZE, keep)


def save(mem: memory.MemoryTier, step: int, rank: int = 0, world: int = 1, job: str = "j") -> str:
    buffer = mem.reserve(job, rank, step, SIZE)
    mem.path(buffer.id).write_bytes(bytes([step % 256]) * SIZE)
    record = manifest.ShardRecord(rank, SIZE, f"crc32:{step:08x}", "node-a", buffer.id)
    mem.commit(job, rank, step, record, world, hold=True)
    return buffer.id


def steps(mem: memory.MemoryTier, job: str = "j") -> list[int]:
    return [m.step for m in mem.manifests(job)]


def test_a_committed_shard_is_held_and_named_in_a_manifest(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    buffer = save(mem, 10)
    record, path = mem.acquire("j", 0, 10)
    mem.unbusy(record.buffer)
    assert record.buffer == buffer
    assert path.read_bytes() == bytes([10]) * SIZE
    written = manifest.load(tmp_path / "jobs" / "j" / "step-0000000000000010")
    assert written is not None
    assert written.shards[0].buffer == buffer


def test_only_the_newest_k_steps_are_kept_and_their_buffers_come_back(tmp_path: Path) -> None:
    mem = tier(tmp_path, keep=2)
    first = save(mem, 1)
    save(mem, 2)
    save(mem, 3)
    assert steps(mem) == [2, 3]
    assert save(mem, 4) == first  # the evicted step's buffer, handed back to the same rank
    assert len(list((tmp_path / "buffers").iterdir())) == 3


def test_when_memory_is_full_the_oldest_steps_go_first(tmp_path: Path) -> None:
    mem = tier(tmp_path, limit_shards=3)
    for step in (1, 2, 3, 4, 5):
        save(mem, step)
    assert steps(mem) == [3, 4, 5]
    assert mem.used() <= 3 * SIZE


def test_the_newest_committed_step_is_never_evicted(tmp_path: Path) -> None:
    mem = tier(tmp_path, limit_shards=3)
    save(mem, 1, rank=0, world=2)
    save(mem, 1, rank=1, world=2)
    mem.protect("j", 1)  # every rank of step 1 is stored: trainers report it committed
    save(mem, 2, rank=0, world=2)  # step 2 is partial; step 1 must stay
    assert steps(mem) == [1, 2]
    with pytest.raises(errors.MemoryFullError, match="full"):
        mem.reserve("j", 1, 2, SIZE)


def test_the_step_being_saved_is_not_evicted_to_make_room_for_itself(tmp_path: Path) -> None:
    mem = tier(tmp_path, limit_shards=1)
    save(mem, 5)
    with pytest.raises(errors.MemoryFullError):
        mem.reserve("j", 1, 5, SIZE)


def test_a_buffer_being_copied_out_is_not_evicted(tmp_path: Path) -> None:
    mem = tier(tmp_path, limit_shards=2)
    save(mem, 1)
    record, _ = mem.acquire("j", 0, 1)  # a peer is reading it
    save(mem, 2)
    with pytest.raises(errors.MemoryFullError):
        mem.reserve("j", 0, 3, SIZE)
    mem.unbusy(record.buffer)
    save(mem, 3)
    assert steps(mem) == [2, 3]


def test_a_commit_needs_its_reservation(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    record = manifest.ShardRecord(0, SIZE, "crc32:0", "node-a", "no-such-buffer")
    with pytest.raises(errors.NotFoundError):
        mem.commit("j", 0, 1, record, 1, hold=True)


def test_a_restarted_daemon_takes_its_shards_back(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    buffer = save(mem, 7)
    again = tier(tmp_path)
    record, path = again.acquire("j", 0, 7)
    assert record.buffer == buffer
    assert path.read_bytes() == bytes([7]) * SIZE


def test_a_finished_job_is_dropped_and_its_buffers_reused(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    buffer = save(mem, 1)
    mem.drop_job("j")
    assert steps(mem) == []
    assert save(mem, 1, job="other") == buffer


def test_a_rank_that_stopped_writing_keeps_its_newest_copy_on_a_peer(tmp_path: Path) -> None:
    """A peer holds copies of ranks 0 and 1; rank 1's node died after step 4. However far
    rank 0 goes, rank 1's step 4 stays: it is what rank 1's recovery restores."""
    mem = tier(tmp_path, limit_shards=20, keep=2)
    for step in (2, 4):
        save(mem, step, rank=0, world=2)
        save(mem, step, rank=1, world=2)
    for step in (6, 8, 10):
        save(mem, step, rank=0, world=2)
    assert steps(mem) == [4, 8, 10]


def test_the_two_newest_committed_steps_outlive_the_keep_count(tmp_path: Path) -> None:
    """The newest committed step may not have reached every peer yet; the one before it
    is kept too, so a node loss still finds a step every rank holds."""
    mem = tier(tmp_path, limit_shards=20, keep=1)
    for step in (2, 4, 6, 8):
        save(mem, step)
        if step in (4, 6):
            mem.protect("j", step)
    assert steps(mem) == [4, 6, 8]


def test_a_pinned_step_stays_until_it_is_unpinned(tmp_path: Path) -> None:
    """A recovery chose step 2; the ranks still running save 4, 6, 8 before they reload."""
    mem = tier(tmp_path, limit_shards=20, keep=1)
    save(mem, 2)
    mem.pin("j", 2)
    for step in (4, 6, 8):
        save(mem, step)
    assert steps(mem) == [2, 8]
    mem.pin("j", None)
    save(mem, 10)
    assert steps(mem) == [10]


def test_a_refused_reservation_evicts_nothing(tmp_path: Path) -> None:
    mem = tier(tmp_path, limit_shards=4)
    for step in (1, 2, 3):
        save(mem, step)
    mem.protect("j", 3)
    with pytest.raises(errors.MemoryFullError):  # evicting steps 1 and 2 would not be enough
        mem.reserve("j", 0, 4, 4 * SIZE)
    assert steps(mem) == [1, 2, 3]


def test_a_buffer_being_copied_is_not_handed_out_when_its_step_goes(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    copying = save(mem, 1)
    mem.busy(copying)  # a tier-2 copy reads it
    mem.drop_job("j")
    assert mem.reserve("j", 0, 2, SIZE).id != copying
    mem.unbusy(copying)
    assert mem.reserve("j", 1, 2, SIZE).id == copying


def test_every_byte_of_a_buffer_is_allocated_when_it_is_reserved(tmp_path: Path) -> None:
    mem = tier(tmp_path, limit_shards=64)
    buffer = mem.reserve("j", 0, 1, 64 * SIZE)
    assert os.stat(mem.path(buffer.id)).st_blocks * 512 >= 64 * SIZE  # not a sparse file


def test_a_full_tmpfs_refuses_the_reservation_and_keeps_no_file(tmp_path: Path) -> None:
    with tmpfs.mounted(tmp_path / "shm", "1m") as shm:
        mem = memory.MemoryTier(shm, "node-a", 64 << 20, keep=2)  # the bound is not the limit
        with pytest.raises(errors.MemoryFullError, match="no room"):
            mem.reserve("j", 0, 1, 4 << 20)
        assert list((shm / "buffers").iterdir()) == []
        assert mem.used() == 0


def stale(mem: memory.MemoryTier, buffer: memory.Buffer) -> None:
    """Make a reservation older than the lease."""
    buffer.since -= mem.lease + 1


def test_a_reclaimed_reservation_is_never_committed_or_handed_out(tmp_path: Path) -> None:
    mem = tier(tmp_path)
    stalled = mem.reserve("j", 0, 1, SIZE)
    stale(mem, stalled)
    other = mem.reserve("j", 1, 1, SIZE)  # the lease of rank 0's reservation ran out
    assert other.id != stalled.id
    assert mem.used() == 2 * SIZE  # its trainer may still write: still counted
    record = manifest.ShardRecord(0, SIZE, "crc32:0", "node-a", stalled.id)
    with pytest.raises(errors.NotFoundError):
        mem.commit("j", 0, 1, record, 2, hold=True)
    mem.reserve("j", 0, 2, SIZE)  # rank 0's trainer moved on: the file goes
    assert not (tmp_path / "buffers" / stalled.id).exists()


class SlowDisk(files.DiskTier):
    """Tier 2 that starts copying only once the test lets it."""

    go = threading.Event()

    def store(self, *args: object, **kwargs: object) -> float:
        assert self.go.wait(30)
        return super().store(*args, **kwargs)  # type: ignore[arg-type]


def test_a_buffer_is_not_reused_while_its_tier_2_copy_runs(tmp_path: Path) -> None:
    mem = tier(tmp_path / "memory", limit_shards=2)
    disk = SlowDisk(tmp_path / "disk", "node-a", keep=2)
    node = daemon.Daemon("node-a", "t", mem, disk, [], keep=2)
    try:
        buffer = mem.reserve("j", 0, 1, SIZE)
        mem.path(buffer.id).write_bytes(b"a" * SIZE)
        record = manifest.ShardRecord(0, SIZE, checksum.of(b"a" * SIZE), "node-a", buffer.id)
        options = daemon.SaveOptions(1, ("memory", "local"))
        node.stored("j", 0, 1, record, options)
        mem.drop_job("j")  # the step goes while its copy to disk waits
        again = mem.reserve("k", 0, 1, SIZE)
        mem.path(again.id).write_bytes(b"b" * SIZE)
        SlowDisk.go.set()
        assert node.status("j", 0, 1, wait=30)["tiers"]["local"]["state"] == "ok"
    finally:
        node.pool.shutdown(wait=True)
    _, path = disk.locate("j", 0, 1)
    assert path.read_bytes() == b"a" * SIZE


def test_a_job_over_its_own_bound_evicts_its_own_old_steps_never_another_jobs(
    tmp_path: Path,
) -> None:
    """Issue 31, finding 8: with --max-job-bytes one job cannot take a node's tier 1."""
    mem = memory.MemoryTier(tmp_path, "node-a", 8 * SIZE, keep=10, job_limit=3 * SIZE)
    for step in (1, 2):
        save(mem, step, job="quiet")
    for step in (1, 2, 3, 4, 5, 6):
        save(mem, step, job="greedy")

    assert steps(mem, "quiet") == [1, 2]  # memory had room for all; the bound took greedy's
    assert steps(mem, "greedy") == [4, 5, 6]
    save(mem, 7, job="greedy")  # 4 goes
    mem.protect("greedy", 6)
    mem.protect("greedy", 7)  # 6 and 7: its two newest committed steps, never evicted
    with pytest.raises(errors.MemoryFullError, match=r"job greedy holds .* \(--max-job-bytes\)"):
        mem.reserve("greedy", 1, 8, 2 * SIZE)  # 5 may go, 6 and 7 may not: 4 shards > 3
    assert steps(mem, "greedy") == [6, 7]  # what could go went; nothing of quiet's
    assert steps(mem, "quiet") == [1, 2]


def test_without_a_job_bound_one_job_may_fill_the_memory(tmp_path: Path) -> None:
    mem = memory.MemoryTier(tmp_path, "node-a", 4 * SIZE, keep=10)
    for step in (1, 2, 3, 4):
        save(mem, step, job="only")
    assert steps(mem, "only") == [1, 2, 3, 4]
