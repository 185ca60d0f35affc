"""Incarnations and timelines: the commit rule, the timeline filter, and a property test.

The property test drives the real stores (tier 1 ``memory.MemoryTier`` and tier 3
``files.Persistent`` on the local file system) through random interleavings of saves, crashes
and restores of a job's incarnations, and restores the way the client does
(``manifest.complete_points``): a restore never returns shards of two incarnations, and never a
step older than the newest step committed in the newest incarnation that has one.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from matrixpool_recovery import checksum, files, manifest, memory

SIZE = 64
WORLD = 2


def holding(rank: int, step: int, incarnation: int, base: int = -1) -> manifest.Holding:
    return manifest.Holding("j", rank, step, "memory", SIZE, "crc32:0", "n", "n", incarnation, base)


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        pytest.param(
            [holding(0, 3, 1), holding(1, 3, 2, base=2), holding(0, 2, 1), holding(1, 2, 1)],
            manifest.Point(1, 2),
            id="two runs' shards of one step are not a committed step",
        ),
        pytest.param(
            [
                holding(0, 3, 2, base=2),
                holding(1, 3, 2, base=2),
                holding(0, 2, 1),
                holding(1, 2, 1),
            ],
            manifest.Point(2, 3),
            id="the newer run's whole step wins",
        ),
        pytest.param(
            [holding(r, s, 1) for r in (0, 1) for s in (1, 2, 3)] + [holding(0, 2, 2, base=1)],
            manifest.Point(1, 1),
            id="steps past the newer run's base lie on an abandoned branch",
        ),
        pytest.param(
            [holding(r, 5, 1) for r in (0, 1)] + [holding(0, 1, 2)],
            None,
            id="a run started from nothing abandons everything older",
        ),
    ],
)
def test_the_step_a_restore_uses(held: list[manifest.Holding], expected: object) -> None:
    assert manifest.choose(held, WORLD) == expected


def test_a_manifest_of_two_runs_is_not_complete() -> None:
    shards = {
        0: manifest.ShardRecord(0, SIZE, "crc32:0", incarnation=1),
        1: manifest.ShardRecord(1, SIZE, "crc32:0", incarnation=2),
    }
    assert not manifest.Manifest("j", 3, "persistent", 2, "", shards).complete


# ---- the property test -----------------------------------------------------------------------


@dataclass
class Model:
    """A job of WORLD ranks saving through the real stores; the truth the stores must keep."""

    root: Path
    incarnation: int = 1
    base: int = -1
    next_step: dict[int, int] = field(default_factory=lambda: dict.fromkeys(range(WORLD), 0))
    committed: dict[int, set[int]] = field(default_factory=dict)  # run -> steps all ranks saved
    saved: dict[tuple[int, int, str], set[int]] = field(default_factory=dict)  # ranks saved

    def __post_init__(self) -> None:
        self.memory = memory.MemoryTier(self.root / "memory", "n", 1 << 20, keep=1000)
        self.persistent = files.Persistent(f"file://{self.root}/persistent", keep=1000)

    def save(self, rank: int, tiers: str) -> None:
        step = self.next_step[rank]
        self.next_step[rank] = step + 1
        data = bytes([self.incarnation % 256]) * SIZE
        digest = checksum.of(data, checksum.CRC32)  # tier 3 reads what it wrote back
        record = manifest.ShardRecord(rank, SIZE, digest, "n", "", self.incarnation, self.base)
        buffer = self.memory.reserve("j", rank, step, SIZE)
        path = self.memory.path(buffer.id)
        path.write_bytes(data)
        held = manifest.ShardRecord(**{**record.__dict__, "buffer": buffer.id})
        self.memory.commit("j", rank, step, held, WORLD, hold="m" in tiers)
        if "p" in tiers:
            self.persistent.store(path, record, "j", step, WORLD)
        if "m" not in tiers:
            self.memory.release_transit(buffer.id)
        for tier in tiers:
            ranks = self.saved.setdefault((self.incarnation, step, tier), set())
            ranks.add(rank)
            if ranks == set(range(WORLD)):
                self.committed.setdefault(self.incarnation, set()).add(step)

    def holdings(self) -> list[manifest.Holding]:
        found = self.memory.manifests("j") + self.persistent.manifests("j")
        return [h for m in found for h in manifest.holdings(m)]

    def crash_and_restore(self, older: bool) -> None:
        """A new incarnation restores the newest committed step (or, as a recovery may
        choose, the oldest one still complete) and goes on from there."""
        points = manifest.complete_points(self.holdings(), WORLD)
        self.check(points)
        chosen = points[-1] if older and points else (points[0] if points else None)
        self.incarnation += 1
        self.base = -1 if chosen is None else chosen.step
        for steps in self.committed.values():  # the branch left behind is not the timeline
            steps.difference_update({s for s in steps if s > self.base})
        self.next_step = dict.fromkeys(range(WORLD), self.base + 1)

    def check(self, points: list[manifest.Point]) -> None:
        found = self.holdings()
        for point in points:
            runs = {
                h.incarnation
                for h in found
                if (h.step, h.incarnation) == (point.step, point.incarnation)
            }
            assert runs == {point.incarnation}
            for rank in range(WORLD):
                assert any(
                    h.rank == rank and h.step == point.step and h.incarnation == point.incarnation
                    for h in found
                ), (point, rank)
        newest_run = max((r for r, steps in self.committed.items() if steps), default=None)
        if newest_run is not None:
            assert points, "a committed step vanished"
            newest = max(self.committed[newest_run])
            assert points[0].step >= newest or points[0].incarnation > newest_run, (
                points[0],
                newest_run,
                newest,
            )
            assert points[0].incarnation >= newest_run


operations = st.lists(
    st.one_of(
        st.tuples(st.just("save"), st.integers(0, WORLD - 1), st.sampled_from(["m", "p", "mp"])),
        st.tuples(st.just("crash"), st.booleans(), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_restores_never_mix_runs_nor_go_behind_the_newest_run(
    ops: list[tuple[str, object, str]],
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        model = Model(Path(folder))
        for kind, arg, tiers in ops:
            if kind == "save":
                assert isinstance(arg, int)
                model.save(arg, tiers)
            else:
                model.crash_and_restore(bool(arg))
        model.check(manifest.complete_points(model.holdings(), WORLD))
