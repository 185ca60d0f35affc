"""Manifests: the record that makes a step committed, and the commit rule.

A manifest lists shards of one job at one step on one tier, each with its size and checksum.
It is written last, after the shards it names are complete, and atomically (temporary file,
fsync, rename, fsync of the directory): a reader sees the old manifest or the new one, never a
half-written one, and never a shard that is still being written.

* Tier 1 and tier 2 are per node: the daemon of each node writes a manifest of the shards it
  holds (its own ranks on both tiers, and the peer copies it keeps in memory).
* Tier 3 is shared: each rank's upload writes a sidecar, and the upload that completes the set
  writes the one manifest listing every rank.

Every shard carries the **incarnation** of the job that wrote it: each run, recovery and resume
of a job is a new incarnation (a number the operator hands out, growing). A step is committed
on a tier when the shards named by that tier's manifests cover every rank **in one
incarnation** (``committed``), so a restore never mixes two runs' bytes. Shards also carry the
step their run restored from (``base``), and timelines follow PostgreSQL's rule: once
incarnation J restored from step B, every shard of an older incarnation past B lies on a branch
J abandoned and is ignored (``timeline``). ``newest_complete`` and
``choose`` pick the step (and incarnation) a restore uses. Called by the daemon (write) and by
the trainer client and the operator (read, decide).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matrixpool_recovery import clock, errors

FILE = "manifest.json"


@dataclass(frozen=True)
class ShardRecord:
    """One shard named by a manifest."""

    rank: int  # whose state
    size: int  # bytes of the whole shard
    checksum: str  # ALGORITHM:HEX over the whole shard
    origin: str = ""  # node whose trainer wrote it (another node for peer copies)
    buffer: str = ""  # tier 1: the daemon's buffer holding it
    incarnation: int = 0  # the run of the job that wrote it
    base: int = -1  # the step that run restored from; -1: it started from nothing

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "size": self.size,
            "checksum": self.checksum,
            "origin": self.origin,
            "buffer": self.buffer,
            "incarnation": self.incarnation,
            "base": self.base,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardRecord:
        return cls(
            rank=int(data["rank"]),
            size=int(data["size"]),
            checksum=str(data["checksum"]),
            origin=str(data.get("origin", "")),
            buffer=str(data.get("buffer", "")),
            incarnation=int(data.get("incarnation", 0)),
            base=int(data.get("base", -1)),
        )


@dataclass(frozen=True)
class Manifest:
    """Shards of one job at one step on one tier, as held by one node (or shared, tier 3)."""

    job: str
    step: int
    tier: str  # memory, local or persistent
    world_size: int  # ranks of the job when the step was saved
    node: str = ""  # holder; "" for the shared tier-3 manifest
    shards: Mapping[int, ShardRecord] = field(default_factory=dict)  # by rank

    def with_shard(self, record: ShardRecord) -> Manifest:
        return Manifest(
            self.job,
            self.step,
            self.tier,
            self.world_size,
            self.node,
            {**self.shards, record.rank: record},
        )

    def without(self, rank: int) -> Manifest:
        shards = {r: s for r, s in self.shards.items() if r != rank}
        return Manifest(self.job, self.step, self.tier, self.world_size, self.node, shards)

    @property
    def complete(self) -> bool:
        """Lists a shard of every rank, all written by one incarnation."""
        return set(self.shards) >= set(range(self.world_size)) and (
            len({s.incarnation for s in self.shards.values()}) == 1
        )

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "job": self.job,
                "step": self.step,
                "tier": self.tier,
                "worldSize": self.world_size,
                "node": self.node,
                "written": clock.utc_now_iso(),
                "shards": [self.shards[r].to_json() for r in sorted(self.shards)],
            },
            indent=1,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        try:
            raw = json.loads(data)
            shards = {int(s["rank"]): ShardRecord.from_json(s) for s in raw["shards"]}
            return cls(
                str(raw["job"]),
                int(raw["step"]),
                str(raw["tier"]),
                int(raw["worldSize"]),
                str(raw.get("node", "")),
                shards,
            )
        except (ValueError, KeyError, TypeError) as err:
            raise errors.IntegrityError(f"corrupt manifest: {err}") from err


def write_atomic(path: Path, data: bytes) -> None:
    """Replace path with data: temporary file, fsync, rename, fsync of the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # unique: PID 1 everywhere
    try:
        with open(temporary, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk keeps no temporary file
        raise
    sync_dir(path.parent)


def sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, manifest: Manifest) -> None:
    write_atomic(directory / FILE, manifest.to_bytes())


def load(directory: Path) -> Manifest | None:
    """The manifest in a step directory; None when there is none (nothing committed there)."""
    try:
        return Manifest.from_bytes((directory / FILE).read_bytes())
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class Holding:
    """A shard some source holds, as an inventory reports it."""

    job: str
    rank: int
    step: int
    tier: str  # memory, local or persistent
    size: int
    checksum: str
    node: str = ""  # the daemon holding it; "" for tier 3
    origin: str = ""  # node whose trainer wrote it
    incarnation: int = 0  # the run of the job that wrote it
    base: int = -1  # the step that run restored from; -1: it started from nothing

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "rank": self.rank,
            "step": self.step,
            "tier": self.tier,
            "size": self.size,
            "checksum": self.checksum,
            "node": self.node,
            "origin": self.origin,
            "incarnation": self.incarnation,
            "base": self.base,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Holding:
        return cls(
            str(data["job"]),
            int(data["rank"]),
            int(data["step"]),
            str(data["tier"]),
            int(data["size"]),
            str(data["checksum"]),
            str(data.get("node", "")),
            str(data.get("origin", "")),
            int(data.get("incarnation", 0)),
            int(data.get("base", -1)),
        )


def holdings(manifest: Manifest) -> list[Holding]:
    return [
        Holding(
            manifest.job,
            s.rank,
            manifest.step,
            manifest.tier,
            s.size,
            s.checksum,
            manifest.node,
            s.origin,
            s.incarnation,
            s.base,
        )
        for s in manifest.shards.values()
    ]


@dataclass(frozen=True, order=True)
class Point:
    """A step of one incarnation; ordered as a restore prefers them (newest run first)."""

    incarnation: int
    step: int


def timeline(found: Iterable[Holding]) -> list[Holding]:
    """The holdings on the newest timeline: a shard of incarnation I at step S is dropped when
    a newer incarnation restored from below S (or wrote a step <= S): S of I lies on the
    branch that run abandoned. A run's base is the newest any of its ranks names (a rank that
    joined it later, starting from nothing, does not move the run's branch point)."""
    listed = list(found)
    first: dict[int, int] = {}  # incarnation -> first step not inherited from older runs
    for h in listed:
        first[h.incarnation] = min(h.step, first.get(h.incarnation, h.step))
    for incarnation in first:
        base = max(h.base for h in listed if h.incarnation == incarnation)
        first[incarnation] = min(first[incarnation], base + 1)
    newer_floor: dict[int, float] = {}  # incarnation -> lowest first step of any newer one
    floor = float("inf")
    for incarnation in sorted(first, reverse=True):
        newer_floor[incarnation] = floor
        floor = min(floor, first[incarnation])
    return [h for h in listed if h.step < newer_floor[h.incarnation]]


def complete_points(
    found: Iterable[Holding], world_size: int, tier: str | None = None
) -> list[Point]:
    """Steps whose shards of one incarnation cover every rank on the newest timeline (on one
    tier, or across tiers), newest first."""
    ranks: dict[Point, set[int]] = {}
    for holding in timeline(found):
        if tier is None or holding.tier == tier:
            ranks.setdefault(Point(holding.incarnation, holding.step), set()).add(holding.rank)
    every = set(range(world_size))
    return sorted((p for p, covered in ranks.items() if covered >= every), reverse=True)


def choose(found: Iterable[Holding], world_size: int, tier: str | None = None) -> Point | None:
    """The step (and incarnation) a restore uses: the newest complete one."""
    return next(iter(complete_points(found, world_size, tier)), None)


def coverage(found: Iterable[Holding], tier: str | None = None) -> dict[int, set[int]]:
    """Ranks held per step (on one tier, or on any tier)."""
    ranks: dict[int, set[int]] = {}
    for holding in found:
        if tier is None or holding.tier == tier:
            ranks.setdefault(holding.step, set()).add(holding.rank)
    return ranks


def newest_complete(
    found: Iterable[Holding], world_size: int, tier: str | None = None
) -> int | None:
    """The newest step whose shards of one incarnation cover every rank (on one tier, or
    across tiers), on the newest timeline."""
    chosen = choose(found, world_size, tier)
    return None if chosen is None else chosen.step


def committed(
    found: Iterable[Holding], world_size: int, tiers: Iterable[str]
) -> dict[str, int | None]:
    """Per tier, the newest step committed for every rank (what TrainingJob status shows)."""
    listed = list(found)
    return {tier: newest_complete(listed, world_size, tier) for tier in tiers}
