"""Tiers 2 and 3: shards as files on node-local disk and under the job's persistent URI.

``DiskTier`` is the daemon's tier 2: ``<data-dir>/jobs/<job>/step-<N>/rank-<R>.shard`` and a
per-node manifest. ``Persistent`` is tier 3 at a ``file://`` URI (a shared file system):
``<path>/<job>/step-<N>/rank-<R>.shard``, a sidecar ``rank-<R>.json`` per rank, and the one
manifest listing every rank, written by whichever upload completes the set. The daemon writes
both; the trainer client reads tier 3 directly when no daemon holds a copy.

Every shard is written to a unique temporary name, fsynced, read back and checked against its
checksum, renamed, then named in a manifest: a crash leaves a step uncommitted, never a
manifest naming a partial file, and a failed write (a full disk) leaves no temporary file.
A shard a manifest (tier 2) or sidecar (tier 3) already names is never replaced: a second write
of the same (job, rank, step) is taken as stored when its checksum is the same and refused
otherwise, so a late upload cannot change a committed file.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from matrixpool_recovery import checksum, errors, manifest, names
from matrixpool_recovery.spec import LOCAL, PERSISTENT

log = logging.getLogger(__name__)
COPY_PIECE = 64 << 20  # bytes per sendfile call
READ_BACK_PIECE = 4 << 20  # bytes per read when a written shard is verified


def copy_file(source: Path, size: int, dest: Path, expected: str | None = None) -> None:
    """Copy `size` bytes of source to dest durably: temporary name, fsync, rename.

    `expected`: the checksum the written bytes must have (read back before the rename).
    """
    place(copied(source, size, dest, expected), dest)


def temporary_name(dest: Path) -> Path:
    """A name beside dest no other writer uses (every daemon is PID 1 in its container)."""
    return dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")


def copied(
    source: Path,
    size: int,
    dest: Path,
    expected: str | None = None,
    timing: list[float] | None = None,
) -> Path:
    """A durable copy of source under a temporary name beside dest, verified against
    `expected` when given (the seconds that took are appended to `timing`); nothing is
    left behind when it fails."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(dest)
    try:
        _copy(source, size, temporary)
        if expected is not None:
            started = time.perf_counter()
            verify_file(temporary, size, expected)
            (timing if timing is not None else []).append(time.perf_counter() - started)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _copy(source: Path, size: int, temporary: Path) -> None:
    with open(source, "rb") as reader, open(temporary, "xb") as writer:
        offset = 0
        for _ in range(size // COPY_PIECE + 2):
            if offset >= size:
                break
            sent = os.sendfile(writer.fileno(), reader.fileno(), offset, size - offset)
            if sent == 0:
                break
            offset += sent
        if offset != size or os.fstat(writer.fileno()).st_size != size:
            raise errors.IntegrityError(f"copied {offset} of {size} bytes of {source}")
        os.fsync(writer.fileno())


def verify_file(path: Path, size: int, expected: str) -> None:
    """Read a written file back and check its checksum (IntegrityError when it differs)."""
    running = checksum.Running(checksum.algorithm_of(expected))
    piece = memoryview(bytearray(min(size, READ_BACK_PIECE) or 1))
    total = 0
    with open(path, "rb", buffering=0) as file:
        for _ in range(size // len(piece) + 2):
            got = file.readinto(piece)
            if not got:
                break
            running.update(piece[:got])
            total += got
    if total != size:
        raise errors.IntegrityError(f"{path} read back {total} of {size} bytes")
    checksum.verify(expected, running, f"{path} read back")


def place(temporary: Path, dest: Path) -> None:
    """Rename a written temporary file over dest (removed if that fails)."""
    try:
        os.replace(temporary, dest)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    manifest.sync_dir(dest.parent)


def _already_stored(
    found: manifest.Manifest | None, record: manifest.ShardRecord, temporary: Path
) -> bool:
    """Whether `found` already names a shard of the record's rank (then the new copy is
    dropped): the same checksum is stored already; a different one is refused, since a
    committed file is never replaced."""
    if found is None or record.rank not in found.shards:
        return False
    temporary.unlink(missing_ok=True)
    held = found.shards[record.rank]
    if held.checksum != record.checksum or held.size != record.size:
        raise errors.IntegrityError(
            f"step {found.step} of {found.job} already holds rank {record.rank}'s shard "
            f"({held.checksum}); a different one ({record.checksum}) is refused"
        )
    return True


def _link_new(temporary: Path, dest: Path, record: manifest.ShardRecord) -> None:
    """Put temporary at dest unless a file is there already (another node's write of the
    same shard, or one whose sidecar a crash lost): that one stays if its bytes are the same
    shard, else this write is refused. Renames over dest where hard links are unsupported."""
    try:
        os.link(temporary, dest)
    except FileExistsError:
        try:
            verify_file(dest, record.size, record.checksum)
        except errors.IntegrityError as err:
            raise errors.IntegrityError(
                f"{dest} holds another shard of rank {record.rank}; refused to replace it"
            ) from err
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        if not dest.exists():  # a file system without hard links: not atomic across nodes
            os.replace(temporary, dest)
    finally:
        temporary.unlink(missing_ok=True)
    manifest.sync_dir(dest.parent)


def shard_name(rank: int) -> str:
    return f"rank-{rank}.shard"


class DiskTier:
    """The daemon's tier 2."""

    def __init__(self, root: Path, node: str, keep: int) -> None:
        self.root = root / "jobs"  # one folder per job
        self.node = node  # this node's name, written in manifests
        self.keep = keep  # steps kept per job
        self.pinned: dict[str, int] = {}  # job -> a step a recovery is restoring: kept
        self._lock = threading.Lock()  # one manifest update at a time
        self.root.mkdir(parents=True, exist_ok=True)

    def step_dir(self, job: str, step: int) -> Path:
        return names.inside(self.root, names.job(job), names.step_dir(step))

    def store(
        self, source: Path, record: manifest.ShardRecord, job: str, step: int, world_size: int
    ) -> float:
        """Write one rank's shard (verified), then name it in the step's manifest; the
        seconds spent reading it back."""
        directory = self.step_dir(job, step)
        with self._lock:
            found = manifest.load(directory)
            if found is not None and _superseded(found, record):
                # A newer run re-saves this rank: the manifest stops naming the old shard
                # before its file is replaced, so no reader pairs old checksum and new bytes.
                manifest.save(directory, found.without(record.rank))
        dest = directory / shard_name(record.rank)
        with self._lock:
            self._prune(job)  # space an earlier failed save could not free
        verified: list[float] = []
        temporary = copied(source, record.size, dest, record.checksum, verified)
        with self._lock:
            found = manifest.load(directory)
            if _already_stored(found, record, temporary):
                return sum(verified)
            place(temporary, dest)
            built = found or manifest.Manifest(job, step, LOCAL, world_size, self.node)
            manifest.save(directory, built.with_shard(record))
            self._prune(job)
        return sum(verified)

    def locate(self, job: str, rank: int, step: int) -> tuple[manifest.ShardRecord, Path]:
        directory = self.step_dir(job, step)
        found = manifest.load(directory)
        if found is None or rank not in found.shards:
            raise errors.NotFoundError(f"node {self.node} disk holds no {job}/{rank}/{step}", 404)
        return found.shards[rank], directory / shard_name(rank)

    def manifests(self, job: str | None = None) -> list[manifest.Manifest]:
        jobs = [self.root / names.job(job)] if job else sorted(self.root.iterdir())
        found: list[manifest.Manifest] = []
        for directory in jobs:
            for step_dir in sorted(directory.glob("step-*")):
                loaded = _load_quiet(step_dir)
                if loaded is not None:
                    found.append(loaded)
        return found

    def _prune(self, job: str) -> None:
        pinned = self.pinned.get(job)
        prune(self.root / job, self.keep, () if pinned is None else (names.step_dir(pinned),))

    def drop_job(self, job: str) -> None:
        self.pinned.pop(job, None)
        shutil.rmtree(self.root / names.job(job), ignore_errors=True)


class Persistent:
    """Tier 3 at a file:// URI, shared by every node of the job."""

    def __init__(self, uri: str, keep: int) -> None:
        parts = urlsplit(uri)
        if parts.scheme != "file" or parts.netloc not in ("", "localhost"):
            raise errors.CheckpointError(
                f"persistent URI {uri!r}: only file:///path is supported (a shared file system)"
            )
        self.uri = uri  # as the job spec gives it
        self.root = Path(unquote(parts.path))  # where job folders go
        self.keep = keep  # committed steps kept per job

    def step_dir(self, job: str, step: int) -> Path:
        return names.inside(self.root, names.job(job), names.step_dir(step))

    def store(
        self, source: Path, record: manifest.ShardRecord, job: str, step: int, world_size: int
    ) -> bool:
        """Write one rank's shard; True when this upload committed the step."""
        directory = self.step_dir(job, step)
        found = manifest.load(directory)
        if found is not None and _superseded(found, record):
            # A newer run re-saves a step an older one committed (it restored from below):
            # the old commit goes before any of its shards is replaced.
            (directory / manifest.FILE).unlink(missing_ok=True)
            manifest.sync_dir(directory)
        dest = directory / shard_name(record.rank)
        sidecar = directory / f"rank-{record.rank}.json"
        temporary = copied(source, record.size, dest, record.checksum)
        side = _load_quiet_file(sidecar)
        if side is not None and _superseded(side, record):
            place(temporary, dest)  # a newer run replaces an older run's shard
        elif _already_stored(side, record, temporary):
            return self._commit_if_complete(directory, job, step, world_size)
        else:
            _link_new(temporary, dest, record)
        manifest.write_atomic(
            sidecar,
            manifest.Manifest(
                job, step, PERSISTENT, world_size, "", {record.rank: record}
            ).to_bytes(),
        )
        return self._commit_if_complete(directory, job, step, world_size)

    def _commit_if_complete(self, directory: Path, job: str, step: int, world_size: int) -> bool:
        shards: dict[int, manifest.ShardRecord] = {}
        for rank in range(world_size):
            sidecar = directory / f"rank-{rank}.json"
            if not sidecar.exists():
                return False
            shards.update(manifest.Manifest.from_bytes(sidecar.read_bytes()).shards)
        built = manifest.Manifest(job, step, PERSISTENT, world_size, "", shards)
        if not built.complete:  # ranks of two incarnations: not a step of either
            return False
        manifest.save(directory, built)
        self._prune(job)
        return True

    def manifests(self, job: str) -> list[manifest.Manifest]:
        found: list[manifest.Manifest] = []
        for step_dir in sorted((self.root / names.job(job)).glob("step-*")):
            loaded = _load_quiet(step_dir)
            if loaded is not None:
                found.append(loaded)
        return found

    def locate(self, job: str, rank: int, step: int) -> tuple[manifest.ShardRecord, Path]:
        directory = self.step_dir(job, step)
        found = manifest.load(directory)
        if found is None or rank not in found.shards:
            raise errors.NotFoundError(f"{self.uri} holds no committed {job}/{rank}/{step}", 404)
        return found.shards[rank], directory / shard_name(rank)

    def _prune(self, job: str) -> None:
        prune(self.root / job, self.keep)


def prune(job_dir: Path, keep: int, also: Iterable[str] = ()) -> None:
    """Keep the newest `keep` committed steps, newer partial ones and the step folders named
    in `also`; delete the rest."""
    steps = sorted(job_dir.glob("step-*"), reverse=True)
    committed = [s for s in steps if (s / manifest.FILE).exists()]
    spared = set(also)
    if len(committed) > keep:
        oldest_kept = committed[keep - 1].name
        for old in steps:
            if old.name < oldest_kept and old.name not in spared:
                shutil.rmtree(old, ignore_errors=True)


def _superseded(found: manifest.Manifest, record: manifest.ShardRecord) -> bool:
    """Whether ``record`` replaces the shard ``found`` names for its rank; a shard of an older
    incarnation than the one held is refused (a run that was already replaced)."""
    held = found.shards.get(record.rank)
    if held is None or held.incarnation == record.incarnation:
        return False
    if held.incarnation > record.incarnation:
        raise errors.CheckpointError(
            f"rank {record.rank} of {found.job} step {found.step}: incarnation "
            f"{record.incarnation} is older than the {held.incarnation} already stored"
        )
    return True


def _load_quiet(directory: Path) -> manifest.Manifest | None:
    try:
        return manifest.load(directory)
    except errors.IntegrityError:
        log.warning("ignoring corrupt manifest in %s", directory)
        return None


def _load_quiet_file(path: Path) -> manifest.Manifest | None:
    try:
        return manifest.Manifest.from_bytes(path.read_bytes())
    except FileNotFoundError:
        return None
