"""Tier 1 of the node daemon: shards in memory, bounded, recycled, outliving trainer pods.

Each shard lives in a buffer file of the daemon's memory directory (a tmpfs such as /dev/shm,
shared with the trainer pods of the node): a trainer on the node writes its shard straight into
a buffer the daemon reserved for it, so tier 1 costs one copy, and the buffer stays the
daemon's when the trainer's process or pod dies. A peer's copy arrives over HTTP into a buffer
the same way.

Buffers are recycled: a step that ages out leaves its buffers in a free pool, and the next save
of the same rank gets one back (already in memory, already mapped by that trainer). The total
of all buffer files, whatever their state and whoever maps them, never exceeds the memory
bound, and every byte of it is allocated when the buffer is reserved (``posix_fallocate``): a
full tmpfs is a 507 then, never a SIGBUS in a trainer touching a sparse page. When a
reservation does not fit, free buffers go first, then the oldest steps, never the newest
committed step of a job (which trainers report; until they do, the newest step held) nor the
step being saved; whether it can fit is decided before anything goes, so a refused reservation
evicts nothing. A dropped buffer's file is truncated before it is unlinked, which frees its
pages even where a trainer still maps it.

A buffer some copy reads (``busy``: a peer push, a tier-2 or tier-3 write, a download) is
neither handed out again nor dropped until the copy ends, whatever its state.

Reservations made for a trainer (POST reserve) are leased: one not committed within the lease
(``--staging-lease``, 600 s by default) is reclaimed. The trainer may still be writing into it
through its mapping, so a reclaimed buffer is never committed, never handed out and never
truncated while that trainer may write: it stays counted until the same (job, rank) reserves
again (its previous save has ended then, and the answer's ``live`` list tells its client to
unmap it) or the job is deleted, and only then is its file dropped. An upload over HTTP holds
its buffer busy while it writes; the daemon's read timeout bounds it instead.

Layout: ``buffers/<id>`` and ``jobs/<job>/step-<N>/manifest.json`` (see ``manifest``). Called
by the daemon's request handlers only.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matrixpool_recovery import errors, manifest, names
from matrixpool_recovery.spec import MEMORY

log = logging.getLogger(__name__)
SHARED_MODE = 0o660  # buffers: the daemon's user and group (trainers) read and write
STAGING_LEASE = 600.0  # seconds a reserved buffer waits for its commit before it is reclaimed

FREE, STAGING, HELD, TRANSIT = "free", "staging", "held", "transit"
RECLAIMED = "reclaimed"  # a lease ran out: counted, unusable until its owner reserves again


@dataclass
class Buffer:
    """One buffer file."""

    id: str  # file name under buffers/, never reused
    size: int  # bytes, as the file is truncated to
    state: str  # free, staging (being written), held (a tier-1 shard), transit (tiers 2-3)
    # or reclaimed
    owner: tuple[str, int] | None  # (job, rank) it was last reserved for
    since: float = 0.0  # monotonic time of the reservation
    busy: int = 0  # readers copying it to a peer, a disk or a URI
    step: int = -1  # step it was reserved for


@dataclass(frozen=True)
class Held:
    """A tier-1 shard: which buffer holds it."""

    record: manifest.ShardRecord
    step: int
    seq: int  # order of arrival on this node


class MemoryTier:
    """The daemon's tier-1 store."""

    def __init__(
        self,
        root: Path,
        node: str,
        limit: int,
        keep: int,
        lease: float = STAGING_LEASE,
        job_limit: int = 0,
    ) -> None:
        self.root = root  # the memory directory
        self.node = node  # this node's name, written in manifests
        self.limit = limit  # bytes all buffers may take together
        self.job_limit = job_limit  # bytes one job's buffers may take; 0: only `limit`
        self.keep = keep  # steps kept per job
        self.lease = lease  # seconds a trainer's reservation waits for its commit
        self._lock = threading.RLock()
        self._buffers: dict[str, Buffer] = {}
        self._steps: dict[tuple[str, int], dict[int, Held]] = {}  # (job, step) -> rank -> Held
        self._world: dict[tuple[str, int], int] = {}  # (job, step) -> world size
        self._committed: dict[str, manifest.Point] = {}  # job -> newest committed for every rank
        self._previous: dict[str, manifest.Point] = {}  # job -> the committed one before that
        self._pinned: dict[str, int] = {}  # job -> a step a recovery is restoring
        self._seq = itertools.count()
        (root / "buffers").mkdir(parents=True, exist_ok=True)
        (root / "jobs").mkdir(parents=True, exist_ok=True)
        self._load()

    # --- reservations ---

    def reserve(self, job: str, rank: int, step: int, size: int) -> Buffer:
        """A buffer of `size` bytes for a shard of (job, rank, step), making room if needed."""
        if size <= 0:
            raise ValueError(f"a shard of {size} bytes")
        with self._lock:
            self._reclaim_stale()
            self._drop_reclaimed(lambda owner: owner == (job, rank))
            self._within_job_limit(job, step, size)
            buffer = self._pick_free(job, rank, size)
            self._make_room(size - (buffer.size if buffer else 0), job, step, buffer)
            if buffer is None:
                buffer = Buffer(uuid.uuid4().hex, 0, FREE, None)
                self._buffers[buffer.id] = buffer
            if buffer.size != size:
                self._allocate(buffer, size)
            buffer.state, buffer.owner, buffer.step = STAGING, (job, rank), step
            buffer.since = time.monotonic()
            return buffer

    def _job_bytes(self, job: str) -> int:
        """Bytes of the buffers a job holds: its shards, its writes and copies in flight, its
        reclaimed reservations (free buffers are the pool's)."""
        return sum(
            b.size
            for b in self._buffers.values()
            if b.state != FREE and b.owner is not None and b.owner[0] == job
        )

    def _within_job_limit(self, job: str, step: int, size: int) -> None:
        """Make room under the job's own bound (``job_limit``) from its own oldest steps, or
        refuse (507) naming the bound: one job cannot take a node's tier 1 from the others."""
        if not self.job_limit or self._job_bytes(job) + size <= self.job_limit:
            return
        own = [k for k in self._eviction_order(job, step) if k[0] == job]
        for key in own:
            if self._job_bytes(job) + size <= self.job_limit:
                return
            self._evict(key)
        if self._job_bytes(job) + size > self.job_limit:
            raise errors.MemoryFullError(
                f"tier-1 memory of node {self.node}: job {job} holds {self._job_bytes(job)} "
                f"bytes of its {self.job_limit}-byte bound (--max-job-bytes) in steps that may "
                f"not be evicted; {size} more asked",
                507,
            )

    def _allocate(self, buffer: Buffer, size: int) -> None:
        """Size the buffer's file and allocate every page of it now: a full tmpfs fails
        here (507), not in a trainer's page fault."""
        path = self._create(buffer.id)
        try:
            os.truncate(path, min(size, buffer.size))
            buffer.size = min(size, buffer.size)
            fd = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as err:
            self._drop(buffer)
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise errors.MemoryFullError(
                f"tier-1 memory of node {self.node}: {self.root} has no room for "
                f"{size} more bytes ({err.strerror})",
                507,
            ) from err
        buffer.size = size

    def _create(self, buffer_id: str) -> Path:
        """The buffer's file, writable by the group: trainer pods share the daemon's group."""
        path = self.path(buffer_id)
        path.touch(exist_ok=True)
        path.chmod(SHARED_MODE)
        return path

    def path(self, buffer_id: str) -> Path:
        if buffer_id not in self._buffers:
            raise errors.NotFoundError(f"no buffer {buffer_id!r}", 404)
        return self.root / "buffers" / buffer_id

    def _pick_free(self, job: str, rank: int, size: int) -> Buffer | None:
        free = [b for b in self._buffers.values() if b.state == FREE and not b.busy]
        for wanted in (
            lambda b: b.owner == (job, rank) and b.size == size,
            lambda b: b.size == size,
            lambda b: b.owner == (job, rank),
            lambda b: True,
        ):
            for buffer in free:
                if wanted(buffer):
                    return buffer
        return None

    def _used(self) -> int:
        return sum(b.size for b in self._buffers.values())

    def _make_room(self, need: int, job: str, step: int, keep: Buffer | None) -> None:
        """Phase 1: refuse, touching nothing, when even dropping and evicting all that may go
        leaves too little. Phase 2: drop free buffers. Phase 3: evict the oldest steps."""
        if self._used() + need <= self.limit:
            return
        order = self._eviction_order(job, step)
        evictable = sum(
            self._buffers[h.record.buffer].size for k in order for h in self._steps[k].values()
        )
        if self._used() - sum(b.size for b in self._free(keep)) - evictable + need > self.limit:
            raise errors.MemoryFullError(
                f"tier-1 memory of node {self.node} is full: {self._used()} of {self.limit} "
                f"bytes held by steps that may not be evicted; {need} more needed",
                507,
            )
        for buffer in sorted(self._free(keep), key=lambda b: -b.size):
            if self._used() + need <= self.limit:
                return
            self._drop(buffer)
        for key in order:
            if self._used() + need <= self.limit:
                return
            self._evict(key)
            for buffer in self._free(keep):
                self._drop(buffer)

    def _free(self, keep: Buffer | None) -> list[Buffer]:
        return [
            b for b in self._buffers.values() if b.state == FREE and not b.busy and b is not keep
        ]

    def _drop(self, buffer: Buffer) -> None:
        """Delete a buffer's file; truncated first, so that a trainer's mapping of it does not
        keep its pages (unlinking alone would)."""
        path = self.path(buffer.id)
        with contextlib.suppress(FileNotFoundError):
            os.truncate(path, 0)
        path.unlink(missing_ok=True)
        del self._buffers[buffer.id]

    def _drop_reclaimed(self, whose: Callable[[tuple[str, int] | None], bool]) -> None:
        """Drop reclaimed buffers whose trainer can no longer write into them."""
        for buffer in list(self._buffers.values()):
            if buffer.state == RECLAIMED and not buffer.busy and whose(buffer.owner):
                self._drop(buffer)

    def _eviction_order(self, job: str, step: int) -> list[tuple[str, int]]:
        """Steps that may go, oldest arrival first."""
        movable = [
            key
            for key in self._steps
            if key[1] not in self._protected(key[0])
            and not (key[0] == job and key[1] >= step)
            and not any(self._buffers[h.record.buffer].busy for h in self._steps[key].values())
        ]
        return sorted(movable, key=lambda key: min(h.seq for h in self._steps[key].values()))

    def _reclaim_stale(self) -> None:
        now = time.monotonic()
        for buffer in self._buffers.values():
            if buffer.state == STAGING and not buffer.busy and now - buffer.since > self.lease:
                log.warning("reclaiming buffer %s: no commit after %.0fs", buffer.id, self.lease)
                buffer.state = RECLAIMED

    # --- commits ---

    def commit(
        self,
        job: str,
        rank: int,
        step: int,
        record: manifest.ShardRecord,
        world_size: int,
        hold: bool,
    ) -> None:
        """Take a written buffer: a tier-1 shard when `hold`, else in transit to tiers 2-3."""
        with self._lock:
            buffer = self._buffers.get(record.buffer)
            if buffer is None or buffer.state != STAGING or buffer.owner != (job, rank):
                raise errors.NotFoundError(
                    f"no reservation {record.buffer!r} for {job}/{rank}", 404
                )
            if self.path(buffer.id).stat().st_size != record.size or buffer.size != record.size:
                raise errors.IntegrityError(f"buffer {buffer.id} is not {record.size} bytes")
            held = self._steps.get((job, step), {}).get(rank)
            if hold and held is not None and held.record.incarnation > record.incarnation:
                raise errors.DaemonError(
                    f"{job}/{rank} step {step}: incarnation {record.incarnation} is older "
                    f"than the {held.record.incarnation} held (a replaced run still saving)",
                    409,
                )
            buffer.state = HELD if hold else TRANSIT
            if hold:
                self._hold(job, rank, step, record, world_size)

    def _hold(
        self, job: str, rank: int, step: int, record: manifest.ShardRecord, world_size: int
    ) -> None:
        held = self._steps.setdefault((job, step), {})
        previous = held.get(rank)
        if previous is not None and previous.record.buffer != record.buffer:
            self._release(previous.record.buffer)
        held[rank] = Held(record, step, next(self._seq))
        self._world[(job, step)] = world_size
        self._write_manifest(job, step)
        self._prune(job)

    def _prune(self, job: str) -> None:
        """Keep the newest `keep` steps of the job, its two newest committed ones, and each
        rank's newest shard held here.

        Why more than the newest committed step: a peer's copy may lag its origin by a step,
        so after that origin node dies, the newest step every rank still has is often the one
        before; and a rank that died writes no newer shard, so its newest copy on a peer is
        the one its recovery needs, however far the other ranks have gone.
        """
        self._drop_abandoned(job)
        steps = sorted((s for j, s in self._steps if j == job), reverse=True)
        kept = self._protected(job) | self._newest_per_rank(job)
        for step in steps[self.keep :]:
            buffers = [h.record.buffer for h in self._steps[(job, step)].values()]
            if step not in kept and not any(self._buffers[b].busy for b in buffers):
                self._evict((job, step))

    def _drop_abandoned(self, job: str) -> None:
        """Shards of older incarnations past the step a newer one restored from lie on an
        abandoned branch (``manifest.timeline``): they can never be restored, so they go
        (unless pinned or being read)."""
        held = [
            (step, rank, h)
            for (j, step), ranks in self._steps.items()
            if j == job
            for rank, h in ranks.items()
        ]
        found = [
            manifest.Holding(
                job,
                rank,
                step,
                MEMORY,
                h.record.size,
                h.record.checksum,
                incarnation=h.record.incarnation,
                base=h.record.base,
            )
            for step, rank, h in held
        ]
        alive = {(h.step, h.rank, h.incarnation) for h in manifest.timeline(found)}
        pinned = self._pinned.get(job)
        for step, rank, h in held:
            buffer = self._buffers[h.record.buffer]
            if (step, rank, h.record.incarnation) in alive or step == pinned or buffer.busy:
                continue
            del self._steps[(job, step)][rank]
            self._release(h.record.buffer)
            log.info(
                "dropped %s/%d step %d of abandoned incarnation %d",
                job,
                rank,
                step,
                h.record.incarnation,
            )
            if self._steps[(job, step)]:
                self._write_manifest(job, step)
            else:
                self._evict((job, step))

    def _protected(self, job: str) -> set[int]:
        """Steps of a job never evicted: the two newest committed ones as trainers report
        them, else (no report yet) the newest step held here."""
        pinned = {self._pinned[job]} if job in self._pinned else set()
        if job in self._committed:
            current = self._committed[job]
            previous = self._previous.get(job, current)
            return {current.step, previous.step} | pinned
        newest = max((s for j, s in self._steps if j == job), default=None)
        return pinned if newest is None else {newest} | pinned

    def _newest_per_rank(self, job: str) -> set[int]:
        newest: dict[int, int] = {}
        for (j, step), held in self._steps.items():
            if j == job:
                for rank in held:
                    newest[rank] = max(step, newest.get(rank, step))
        return set(newest.values())

    def _evict(self, key: tuple[str, int]) -> None:
        for held in self._steps.pop(key).values():
            self._release(held.record.buffer)
        self._world.pop(key, None)
        directory = self._step_dir(*key)
        (directory / manifest.FILE).unlink(missing_ok=True)
        _rmdir_quiet(directory)
        log.info("evicted %s step %d from memory", *key)

    def _release(self, buffer_id: str) -> None:
        buffer = self._buffers.get(buffer_id)
        if buffer is not None:
            buffer.state = FREE

    def _write_manifest(self, job: str, step: int) -> None:
        held = self._steps.get((job, step), {})
        shards = {rank: h.record for rank, h in held.items()}
        built = manifest.Manifest(job, step, MEMORY, self._world[(job, step)], self.node, shards)
        manifest.save(self._step_dir(job, step), built)

    def _step_dir(self, job: str, step: int) -> Path:
        return names.inside(self.root / "jobs", names.job(job), names.step_dir(step))

    # --- readers ---

    def acquire(self, job: str, rank: int, step: int) -> tuple[manifest.ShardRecord, Path]:
        """A held shard and its file, kept from eviction until ``unbusy``."""
        with self._lock:
            held = self._steps.get((job, step), {}).get(rank)
            if held is None:
                raise errors.NotFoundError(f"node {self.node} holds no {job}/{rank}/{step}", 404)
            self._buffers[held.record.buffer].busy += 1
            return held.record, self.path(held.record.buffer)

    def open_buffer(self, job: str, buffer_id: str) -> int:
        """The buffer's file opened for writing, for the trainer of `job` that reserved it
        (``fdpass``): a buffer of another job, or one not being written, is not found."""
        with self._lock:
            buffer = self._buffers.get(buffer_id)
            if buffer is None or buffer.owner is None or buffer.owner[0] != job:
                raise errors.NotFoundError(f"{job} holds no buffer {buffer_id!r}", 404)
            if buffer.state != STAGING:
                raise errors.NotFoundError(f"buffer {buffer_id!r} is not being written", 409)
            return os.open(self.path(buffer_id), os.O_RDWR)

    def open_shard(self, job: str, rank: int, step: int) -> tuple[manifest.ShardRecord, int]:
        """A held shard's file opened read-only, for a trainer of `job` (``fdpass``)."""
        record, path = self.acquire(job, rank, step)
        try:
            return record, os.open(path, os.O_RDONLY)
        finally:
            self.unbusy(record.buffer)

    def busy(self, buffer_id: str) -> Path:
        with self._lock:
            self._buffers[buffer_id].busy += 1
            return self.path(buffer_id)

    def unbusy(self, buffer_id: str) -> None:
        with self._lock:
            buffer = self._buffers.get(buffer_id)
            if buffer is not None:
                buffer.busy -= 1

    def release_transit(self, buffer_id: str) -> None:
        with self._lock:
            buffer = self._buffers.get(buffer_id)
            if buffer is not None and buffer.state == TRANSIT:
                buffer.state = FREE

    def owned(self, job: str, rank: int) -> list[str]:
        """Buffers last reserved for (job, rank): the ones its trainer may still have mapped."""
        with self._lock:
            return [b.id for b in self._buffers.values() if b.owner == (job, rank)]

    def abandon(self, buffer_id: str) -> None:
        """A reservation whose upload failed goes back to the pool."""
        with self._lock:
            buffer = self._buffers.get(buffer_id)
            if buffer is not None and buffer.state == STAGING:
                buffer.state = FREE

    def pin(self, job: str, step: int | None) -> None:
        """Keep ``step`` of ``job`` whatever the trainers do next (None: unpin): a recovery
        chose it, and the ranks still running must not push it out before they reload it."""
        with self._lock:
            if step is None:
                self._pinned.pop(job, None)
            else:
                self._pinned[job] = step

    def protect(self, job: str, step: int | None, incarnation: int = 0) -> None:
        """Remember the newest step of a job committed for every rank (newest incarnation
        first): never evicted."""
        if step is None:
            return
        point = manifest.Point(incarnation, step)
        with self._lock:
            current = self._committed.get(job)
            if current is None or point > current:
                if current is not None:
                    self._previous[job] = current
                self._committed[job] = point

    def manifests(self, job: str | None = None) -> list[manifest.Manifest]:
        with self._lock:
            return [
                manifest.Manifest(
                    j,
                    s,
                    MEMORY,
                    self._world[(j, s)],
                    self.node,
                    {r: h.record for r, h in held.items()},
                )
                for (j, s), held in sorted(self._steps.items())
                if job is None or j == job
            ]

    def drop_job(self, job: str) -> None:
        """Forget a finished job; its buffers go to the free pool."""
        with self._lock:
            self._committed.pop(job, None)
            self._previous.pop(job, None)
            self._pinned.pop(job, None)
            for key in [k for k in self._steps if k[0] == job]:
                self._evict(key)
            self._drop_reclaimed(lambda owner: owner is not None and owner[0] == job)

    def used(self) -> int:
        with self._lock:
            return self._used()

    # --- restart ---

    def _load(self) -> None:
        """Take back the shards a previous run of the daemon left in the memory directory."""
        files = {p.name: p.stat().st_size for p in (self.root / "buffers").iterdir()}
        for buffer_id, size in files.items():
            self._buffers[buffer_id] = Buffer(buffer_id, size, FREE, None)
        for directory in sorted((self.root / "jobs").glob("*/step-*")):
            found = _load_quiet(directory)
            if found is None:
                continue
            for rank, record in found.shards.items():
                buffer = self._buffers.get(record.buffer)
                if buffer is None or buffer.size != record.size:
                    continue
                buffer.state, buffer.owner = HELD, (found.job, rank)
                held = self._steps.setdefault((found.job, found.step), {})
                held[rank] = Held(record, found.step, next(self._seq))
                self._world[(found.job, found.step)] = found.world_size
        log.info("memory tier: %d buffers, %d steps taken back", len(files), len(self._steps))


def _load_quiet(directory: Path) -> manifest.Manifest | None:
    try:
        return manifest.load(directory)
    except errors.IntegrityError:
        log.warning("ignoring corrupt manifest in %s", directory)
        return None


def _rmdir_quiet(directory: Path) -> None:
    with contextlib.suppress(OSError):
        directory.rmdir()
