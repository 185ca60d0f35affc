"""Tiers 2 and 3: shards as files on node-local disk and under the job's persistent URI.

``DiskTier`` is the daemon's tier 2: ``<data-dir>/jobs/<job>/step-<N>/rank-<R>.shard`` and a
per-node manifest. ``Persistent`` is tier 3 at a ``file://`` URI (a shared file system):
``<path>/<job>/step-<N>/rank-<R>.shard``, a sidecar ``rank-<R>.json`` per rank, and the one
manifest listing every rank, written by whichever upload completes the set. The daemon writes
both; the trainer client reads tier 3 directly when no daemon holds a copy.

Every shard is written to a temporary name, fsynced and renamed, then named in a manifest:
a crash leaves a step uncommitted, never a manifest naming a partial file.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from matrixpool_recovery import errors, manifest, names
from matrixpool_recovery.spec import LOCAL, PERSISTENT

log = logging.getLogger(__name__)
COPY_PIECE = 64 << 20  # bytes per sendfile call


def copy_file(source: Path, size: int, dest: Path) -> None:
    """Copy `size` bytes of source to dest durably: temporary name, fsync, rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    temporary = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(source, "rb") as reader, open(temporary, "wb") as writer:
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
    os.replace(temporary, dest)
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
    ) -> None:
        directory = self.step_dir(job, step)
        with self._lock:
            found = manifest.load(directory)
            if found is not None and _superseded(found, record):
                # A newer run re-saves this rank: the manifest stops naming the old shard
                # before its file is replaced, so no reader pairs old checksum and new bytes.
                manifest.save(directory, found.without(record.rank))
        copy_file(source, record.size, directory / shard_name(record.rank))
        with self._lock:
            found = manifest.load(directory) or manifest.Manifest(
                job, step, LOCAL, world_size, self.node
            )
            manifest.save(directory, found.with_shard(record))
            self._prune(job)

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
        copy_file(source, record.size, directory / shard_name(record.rank))
        sidecar = directory / f"rank-{record.rank}.json"
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
