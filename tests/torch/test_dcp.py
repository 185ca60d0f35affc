"""``matrixpool_recovery.torch``: DCP's save, async_save and load on the checkpoint tiers, two
gloo ranks as processes (``tests/torch/dcp_worker.py``) against real daemons, each rank on its
own node's daemon, each daemon the other's tier-1 peer."""

from __future__ import annotations

import asyncio
import pickle
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from matrixpool.api import labels
from matrixpool.k8s import daemonclient
from matrixpool_recovery import errors, manifest, names, shard
from matrixpool_recovery import restore as restore_codec
from matrixpool_recovery import spec as recovery_spec
from tests.checkpoint.conftest import OPERATOR, Cluster
from tests.torch.conftest import NODES, Gang, annotate, pod_env, require

torch = require("torch")
dcp_worker = require("tests.torch.dcp_worker")
dcp = require("torch.distributed.checkpoint")
dcp_storage = require("matrixpool_recovery.torch")

FIRST, SECOND, THIRD = 1_000, 2_000, 3_000  # incarnations: first run, recoveries
SPEC = {"memory": {"everySteps": 2, "peerReplicas": 1}}

# A rank's load in this process has no process group; DCP warns that it loads alone.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def gang(daemons: Cluster) -> Callable[..., Gang]:
    """A job of two DCP ranks: ``gang(name, spec=SPEC)``."""

    def make(name: str, spec: dict[str, Any] | None = None) -> Gang:
        return Gang(daemons, name, spec if spec is not None else SPEC)

    return make


def expected(step: int, rank: int) -> str:
    """The digest of the plain state rank ``rank`` saved at ``step``."""
    return str(dcp_worker.plain_digest(dcp_worker.plain_state(step, rank)))


def one(lines: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The rank's line holding ``key``."""
    found = [line for line in lines if key in line]
    assert len(found) == 1, f"{key} in {lines}"
    return found[0]


def operator_view(
    cluster: Cluster, job: str, nodes: tuple[str, ...], uri: str | None = None
) -> Any:
    """What the operator's daemon client reads of ``job`` (``status.checkpoints``, recovery)."""
    endpoints = {n: cluster.address(n) for n in nodes}
    return asyncio.run(daemonclient.inventory(job, endpoints, uri, bearer=OPERATOR))


def buffer_of(cluster: Cluster, node: str, job: str, step: int, rank: int) -> Path:
    """The file holding ``rank``'s shard of ``step`` in ``node``'s daemon memory (tier 1)."""
    memory = cluster.nodes[node].memory_dir
    found = manifest.load(memory / "jobs" / job / names.step_dir(step))
    assert found is not None, f"{node} holds no step {step} of {job}"
    return memory / "buffers" / found.shards[rank].buffer


def flip(path: Path, offset: int) -> None:
    """Corrupt one byte of a stored shard, as a bad DIMM or disk would."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def entry_offset(path: Path, name: str) -> int:
    """Where entry ``name`` of the shard in ``path`` starts."""
    data = path.read_bytes()
    length = shard.header_length(data[: shard.PREFIX])
    layout = shard.parse(data[: shard.PREFIX], data[shard.PREFIX : shard.PREFIX + length])
    entry = next(e for e in layout.entries if e.name == name)
    return layout.payload_start + entry.offset


def test_two_ranks_save_and_load_through_the_daemons_in_the_checkpointer_format(
    gang: Callable[..., Gang], daemons: Cluster
) -> None:
    spec = {**SPEC, "local": {"everySteps": 4}}
    job = gang("ml.dcp-trip", spec)
    saved = job.run("plain", "--save", "2", "--save", "4", incarnation=FIRST)
    assert [[line["saved"] for line in lines if "saved" in line] for lines in saved] == [[2, 4]] * 2
    loaded = job.run("plain", "--load", incarnation=FIRST)
    for rank, lines in enumerate(loaded):
        assert one(lines, "latest")["latest"] == "4"
        assert one(lines, "loaded")["digest"] == expected(4, rank)
    # The operator sees a DCP checkpoint as any other: per tier, as its schedule says.
    seen = operator_view(daemons, job.name, NODES)
    assert seen.committed(2) == {"memory": 4, "local": 4, "persistent": None}
    assert {(h.step, h.tier) for h in seen.holdings if h.rank == 1} == {
        (2, "memory"),
        (4, "memory"),
        (4, "local"),
    }
    # One format: a rank's shard, with the Metadata first in rank 0's.
    with daemons.client("node-a", job.name, 0, 2) as reader:
        restored = reader.restore(4)
    assert next(iter(restored.state)) == dcp_storage.METADATA
    assert "dcp/own0@0" in restored.state
    assert torch.equal(restored.state["dcp/own0@0"], dcp_worker.plain_state(4, 0)["own0"])


def load_as(
    job: Gang, rank: int, node: str, incarnation: int = FIRST
) -> tuple[dict[str, Any], Any]:
    """Load what ``latest()`` names as rank ``rank`` of ``job`` on ``node`` would, in this
    process (no process group: DCP plans for this rank alone); the state and the reader."""
    env = pod_env(
        job.cluster, job.name, rank, job.world, node, job.spec, incarnation, job.annotations(rank)
    )
    me = dcp_storage.Rank.from_env(env)
    step = dcp_storage.latest(me)
    assert step is not None, f"rank {rank}: nothing to load"
    state = dcp_worker.plain_state(0, rank)
    reader = dcp_storage.StorageReader(rank=me)
    dcp.load(state, checkpoint_id=step, storage_reader=reader, no_dist=True)
    return state, reader


def test_a_step_rank_0_never_stored_is_not_the_latest(
    gang: Callable[..., Gang], daemons: Cluster
) -> None:
    """Rank 0 dies in finish() of step 4: rank 1's shard of 4 is stored, rank 0's (with the
    Metadata) never is; latest() is step 2, and loads."""
    job = gang("ml.dcp-torn")
    job.run(
        "plain", "--save", "2", "--save", "4", "--crash-at-finish", "4",
        incarnation=FIRST, failing=(0, 1),
    )  # fmt: skip
    seen = operator_view(daemons, job.name, NODES)
    assert {h.rank for h in seen.holdings if h.step == 4 and h.tier == "memory"} == {1}
    for rank, node in enumerate(NODES):
        state, reader = load_as(job, rank, node)
        assert reader.checkpoint_id == "2"
        assert dcp_worker.plain_digest(state) == expected(2, rank)


def test_a_rank_whose_daemon_is_lost_loads_from_the_peer_copy_then_from_tier_3(
    gang: Callable[..., Gang], daemons: Cluster
) -> None:
    daemons.persistent.mkdir(parents=True, exist_ok=True)
    tier3 = {"everySteps": 2, "uri": f"file://{daemons.persistent}"}
    job = gang("ml.dcp-lost", {**SPEC, "persistent": tier3})
    job.run("plain", "--save", "2", incarnation=FIRST)
    daemons.kill("node-a")  # rank 0's node daemon
    b = daemons.address("node-b")
    job.restore(restore_codec.restore_value(2, [b], "r1", incarnation=SECOND, of=FIRST))
    state, reader = load_as(job, 0, "node-a")
    assert dcp_worker.plain_digest(state) == expected(2, 0)
    assert reader.metadata_source == "peer:node-b"
    assert reader.sources[0] == "peer:node-b"
    state, reader = load_as(job, 1, "node-b")
    assert dcp_worker.plain_digest(state) == expected(2, 1)
    assert set(reader.sources.values()) == {"memory:node-b"}  # its own, and rank 0's peer copy
    daemons.kill("node-b")  # every daemon lost: tier 3 alone
    job.restore(restore_codec.restore_value(2, [], "r2", incarnation=THIRD, of=FIRST))
    for rank, node in enumerate(NODES):
        state, reader = load_as(job, rank, node)
        assert dcp_worker.plain_digest(state) == expected(2, rank)
        assert reader.metadata_source == "persistent"
        assert set(reader.sources.values()) == {"persistent"}


def test_a_corrupt_copy_is_read_from_another_and_none_left_is_an_error_naming_step_and_rank(
    gang: Callable[..., Gang], daemons: Cluster
) -> None:
    job = gang("ml.dcp-rot")
    job.run("plain", "--save", "2", incarnation=FIRST)
    own_of_1 = buffer_of(daemons, "node-b", job.name, 2, 1)
    flip(own_of_1, own_of_1.stat().st_size - 1)
    own_of_0 = buffer_of(daemons, "node-a", job.name, 2, 0)
    flip(own_of_0, entry_offset(own_of_0, dcp_storage.METADATA) + 100)  # inside the pickle
    state, reader = load_as(job, 0, "node-a")
    assert dcp_worker.plain_digest(state) == expected(2, 0)
    assert reader.metadata_source == "peer:node-b"
    assert reader.sources[0] == "peer:node-b"
    state, reader = load_as(job, 1, "node-b")
    assert dcp_worker.plain_digest(state) == expected(2, 1)
    assert reader.sources[1] == "peer:node-a"
    peer_of_1 = buffer_of(daemons, "node-a", job.name, 2, 1)
    flip(peer_of_1, peer_of_1.stat().st_size - 1)
    failure = dcp.api.CheckpointException  # DCP's, holding each rank's error
    with pytest.raises(failure, match="no valid copy of rank 1 at step 2") as failed:
        load_as(job, 1, "node-b")
    assert "memory:node-b" in str(failed.value)  # each copy tried, with what was wrong
    assert "peer:node-a" in str(failed.value)
    assert "checksum" in str(failed.value)


@pytest.mark.parametrize(
    ("model", "saving"),
    [("ddp", ()), ("fsdp", ("--async",))],
    ids=["a DDP job saving with dcp.save", "an FSDP2 job saving with dcp.async_save"],
)
def test_after_a_spare_swap_rank_0_restores_from_the_peer_copy_and_ends_bitwise(
    gang: Callable[..., Gang], daemons: Cluster, model: str, saving: tuple[str, ...]
) -> None:
    """The first run checkpoints up to step 6 and goes on to step 10 fault-free (the
    reference). Then rank 0's node is lost; the recovery moves rank 0 to a spare node (a
    fresh daemon) and names step 6 and the surviving daemon in the restore annotation. Both
    ranks reload step 6 (rank 0 from the peer copy, and items rank 1 saved) and train on: the
    parameters at step 10 are the reference's."""
    job = gang(f"ml.dcp-{model}")
    train = ["train", "--model", model, "--every", "2", "--until", "10", *saving]
    first = job.run(*train, "--save-until", "6", incarnation=FIRST)
    assert [one(lines, "restored")["restored"] for lines in first] == [None, None]
    reference = {one(lines, "finished")["digest"] for lines in first}
    assert len(reference) == 1
    assert operator_view(daemons, job.name, NODES).committed(2)["memory"] == 6
    daemons.kill("node-a")
    daemons.start("node-c", ("node-b",), "--memory-bytes", "1Gi")  # the spare node's daemon
    daemons.set_peers("node-b", ["node-c"])  # as the operator's peers controller does
    b = daemons.address("node-b")
    job.restore(restore_codec.restore_value(6, [b], "r1", incarnation=SECOND, of=FIRST))
    second = job.run(*train, incarnation=FIRST, nodes=("node-c", "node-b"))
    rank0 = one(second[0], "restored")
    assert rank0["restored"] == 6
    assert rank0["metadata"] == "peer:node-b"
    assert rank0["sources"]["0"] == "peer:node-b"  # its own shard's copy on the survivor
    assert "1" in rank0["sources"]  # items rank 1 saved (DCP stores replicated ones once)
    assert one(second[1], "restored")["restored"] == 6
    assert {one(lines, "finished")["digest"] for lines in second} == reference
    seen = operator_view(daemons, job.name, ("node-b", "node-c"))
    assert seen.committed(2)["memory"] == 10
    assert seen.incarnation_of(10) == SECOND


def test_async_save_returns_once_staged_and_saves_what_was_staged(
    gang: Callable[..., Gang], tmp_path: Path
) -> None:
    """Rank 0's async_save returns while its save still waits for rank 1 (which has not
    called it yet): the stall was the staging alone. Rank 0 then changes every tensor; the
    checkpoint holds the staged values."""
    job = gang("ml.dcp-async")
    ranks = job.run("async-check", "--flag", str(tmp_path / "rank0-staged"), incarnation=FIRST)
    assert one(ranks[0], "pending_at_return")["pending_at_return"] is True
    for lines in ranks:
        check = one(lines, "staged")
        assert check["staged"] != check["after"]
        assert one(lines, "loaded")["loaded"] == check["staged"]


def test_async_saves_stage_into_one_reused_copy_and_an_overlapping_one_into_its_own() -> None:
    staged = dcp_storage.StagedCopy()
    state = {"w": torch.ones(4), "nested": {"b": torch.zeros(2, dtype=torch.bfloat16)}, "n": 3}
    first, lease = staged.stage(state)
    overlapping, none = staged.stage(state)  # the first save still reads its copy
    assert none is None
    assert overlapping["w"].data_ptr() != first["w"].data_ptr()
    staged.release(lease)
    state["w"].add_(1)
    again, lease = staged.stage(state)
    assert lease is not None
    assert again["w"].data_ptr() == first["w"].data_ptr()  # the copy, reused
    assert torch.equal(again["w"], torch.full((4,), 2.0))
    state["w"].add_(1)  # the loop goes on: the staged copy keeps what was staged
    assert torch.equal(again["w"], torch.full((4,), 2.0))
    assert again["n"] == 3
    staged.release(lease)
    bigger = {**state, "w": torch.ones(8)}
    resized, _ = staged.stage(bigger)  # another layout: a new copy
    assert resized["w"].shape == (8,)


def test_the_restore_annotation_is_read_from_the_pods_annotations_file(tmp_path: Path) -> None:
    path = tmp_path / "annotations"
    value = restore_codec.restore_value(4, ["10.0.0.7:7040"], "r1", incarnation=9, of=7)
    annotate(path, {labels.RESTORE: value, labels.CHECKPOINT_REQUEST: "req-1"})
    read = restore_codec.read_annotations(path)
    assert read == {labels.RESTORE: value, labels.CHECKPOINT_REQUEST: "req-1"}
    assert restore_codec.ANNOTATION == labels.RESTORE
    assert restore_codec.read_annotations(tmp_path / "absent") == {}


class _Failing:
    """A save handle whose tiers failed as ``failures`` says (the daemon's answers)."""

    def __init__(self, step: int, failures: dict[str, str]) -> None:
        self.step, self.failures = step, failures

    def wait_staged(self) -> None:
        """Staged at once."""

    def wait(self) -> None:
        if self.failures:
            raise errors.TierWriteError(self.step, self.failures)


def test_a_tier_failed_beside_one_that_stored_is_a_warning_none_stored_is_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer copy that failed must not stop a user's training loop (the step is in memory
    and counts there); a step stored on no tier due is an error. The error survives DCP's
    gathering of a rank's exception to every rank (pickled)."""
    saved: list[tuple[int, tuple[str, ...]]] = []
    failures: dict[str, str] = {}

    class Checkpointer:
        spec = recovery_spec.CheckpointSpec(memory_every=2, peer_replicas=1)

        def save(self, step: int, state: Any, tiers: Any, borrow: bool) -> _Failing:
            saved.append((step, tuple(tiers)))
            return _Failing(step, failures)

    me = types.SimpleNamespace(checkpointer=Checkpointer())
    writer = dcp_storage.StorageWriter(rank=me)  # type: ignore[arg-type]
    writer.reset("4")
    failures.update(peers="node-c: unreachable")
    with caplog.at_level("WARNING"):
        writer._save({"x": torch.zeros(2)})
    assert "step 4 not stored on every tier" in caplog.text
    assert saved == [(4, ("memory",))]  # the peer copies are part of tier 1
    failures.update(memory="full")
    with pytest.raises(errors.TierWriteError, match="checkpoint step 4 failed") as raised:
        writer._save({"x": torch.zeros(2)})
    copy = pickle.loads(pickle.dumps(raised.value))
    assert (copy.step, copy.failures) == (4, {"memory": "full", "peers": "node-c: unreachable"})
