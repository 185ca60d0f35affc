"""``torch.distributed.checkpoint`` (DCP) storage on the checkpoint tiers. Called by trainers::

    import torch.distributed.checkpoint as dcp
    from matrixpool_recovery.torch import StorageReader, StorageWriter, latest

    step = latest()  # str(step) of the newest checkpoint every rank committed, any tier; None
    if step is not None:
        dcp.load(state, checkpoint_id=step, storage_reader=StorageReader())
    ...
    dcp.save(state, checkpoint_id=str(n), storage_writer=StorageWriter())  # or dcp.async_save

Inside a pod the operator wrote nothing else is needed: job, rank, world size, incarnation,
the tier schedule, the node's daemon and the credential come from the pod's env
(``client.Checkpointer.from_env``), the restore annotation from its annotations file
(``MATRIXPOOL_ANNOTATIONS_FILE``). The process is the rank: one ``Rank`` per process
(``this_rank``), shared by the writers and readers it makes (one per DCP call). Every call
also takes ``rank=`` (a ``Rank`` of one's own: tests, several jobs in one process).

One format. A DCP checkpoint of step S is, for each rank, that rank's shard of S in the
Checkpointer's format (``shard``), saved by the rank's ``Checkpointer``: the tiers the schedule
names for S (``spec.CheckpointSpec.due``), peer copies, incarnation and base, the commit rule
(a step counts once every rank's shard is stored). The daemons' inventories, the operator's
``status.checkpoints`` and its recovery ladder see it as any other checkpoint.
* Each DCP write item is one entry of its rank's shard, ``dcp/<fqn>`` (``@<offsets>`` for a
  chunk): a tensor entry, or a bytes entry for an object DCP serialised.
  ``Metadata.storage_data`` maps every item to a ``Stored`` (the rank, the entry).
* The DCP ``Metadata`` is the first entry of rank 0's shard (``dcp-metadata``: a checksum of
  its own, then the pickle), and rank 0 saves its shard last, in ``finish``, once every rank
  stored its own: like DCP's ``.metadata`` file it marks the checkpoint whole, so a committed
  step always has it. It is as durable as rank 0's data (peer copies, tiers 2 and 3: a lost
  daemon does not lose it), and every reader fetches that entry alone from the fastest copy,
  checked against its own checksum, never the whole of rank 0's shard.

Saving (``StorageWriter``). ``dcp.save`` returns once every tier due answered. A tier that
failed while another stored the step (a peer copy, a disk) is logged as a warning and the save
returns: the step counts on the tiers that hold it. Only a step stored on no tier due is raised
(``errors.TierWriteError``, inside DCP's ``CheckpointException``). At a step where
the schedule names no tier nothing is stored (``tiers=`` saves it anyway, e.g.
``spec.configured()`` to answer a checkpoint request). The state is
lent to the Checkpointer (``borrow``: CPU tensors are not copied again). For
``dcp.async_save`` the writer is DCP's ``AsyncStager``: it stages into one CPU copy per
process, made once per layout of the state and reused (pinned when an accelerator is
present), so the training loop stalls for that copy only. The copy is lent to the save
until it has been written into the daemon; an ``async_save`` made before that (the previous
one not awaited) stages into a fresh copy instead of waiting.

Restoring (``StorageReader``). The checkpoint's copies are looked up once per load: the node's
daemon, the daemons the restore annotation names, the peers, tier 3 (``client.Copies``).
``read_data`` groups the items by the rank that saved them and reads each such shard whole,
verified, from its fastest copy (own memory, peer memory, local disk, peer disk, tier 3),
falling to the next copy on a corrupt, partial or missing one; when none is left it raises
``errors.NoCheckpointError`` naming the step and the rank. ``sources`` then says where each
shard came from.

The restore annotation (``matrixpool.dev/restore``, ``restore``), read at every ``latest``; a
value this process has not followed yet:
* names a step (a recovery or a resume): ``latest`` returns it until it is loaded, and the
  reader uses the incarnation that wrote it (``of``) and asks the daemons it names (``from``);
* says ``fresh`` (no checkpoint yet): ``latest`` returns None;
* either way the rank runs as its ``incarnation`` from then on (``start_incarnation``): saves
  carry it, and the step loaded as their base.
Otherwise ``latest`` is the newest step committed for every rank that this rank's sources
hold; with a process group up, every rank calls it and all get the lowest any found.

Errors: ``errors.NoCheckpointError`` (no such step, no valid copy of a rank's shard),
``errors.IntegrityError`` (a stored item of the wrong size), ``errors.TierWriteError`` (a
save's tier failed), ``ValueError`` (no ``checkpoint_id``, a process group whose ranks are not
the job's, an unreadable restore annotation). Needs torch >= 2.6 (``torch.accelerator``;
tested with 2.15, ``tools/torch-venv.sh``); the rest of the package imports without torch.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import _state_dict_utils as state_dicts
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from torch.futures import Future

from matrixpool_recovery import checksum, client, errors, manifest, names, restore, staging

log = logging.getLogger(__name__)

ANNOTATIONS_VARIABLE = "MATRIXPOOL_ANNOTATIONS_FILE"  # the pod's downward-API annotations
METADATA = "dcp-metadata"  # rank 0's entry holding the DCP Metadata
ITEM = "dcp/"  # prefix of the entries holding write items
SEAL = b"MPDCP1 "  # starts the Metadata entry: then its checksum, a newline, the pickle
COORDINATOR = 0  # the rank whose shard holds the Metadata (DCP's coordinator)


@dataclass(frozen=True)
class Stored:
    """Where one DCP write item lies: a value of ``Metadata.storage_data``."""

    rank: int  # whose shard holds it
    entry: str  # its entry in that shard


class StagedCopy:
    """The CPU copy async saves stage into: made once per layout of the state and reused,
    pinned when an accelerator is present, lent to one save at a time (a lease). A save staged
    while the copy is still lent (the previous async save not done yet, or failed before it
    wrote) gets a copy of its own, made then and dropped after."""

    def __init__(self) -> None:
        self._copy: dict[str, Any] | None = None  # the staged state dict
        self._layout: Any = None  # the layout it was made for (``layout``)
        self._lease: object | None = None  # the save reading it; None: free
        self._lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], object | None]:
        """A copy of `state_dict` and its lease (None: a copy of its own, nothing to give back)."""
        pinned = torch.accelerator.is_available()
        lease: object | None = object()
        with self._lock:
            if self._lease is None:
                self._lease = lease
            else:
                lease = None
        try:
            shape = layout(state_dict)
            if lease is None or self._copy is None or shape != self._layout:
                made = state_dicts._create_cpu_state_dict(state_dict, pin_memory=pinned)
                if lease is not None:
                    self._copy, self._layout = made, shape
            else:
                made = self._copy
            staged = state_dicts._copy_state_dict(state_dict, made, non_blocking=pinned)
            if pinned:
                torch.accelerator.synchronize()
        except BaseException:
            self.release(lease)
            raise
        return staged, lease

    def release(self, lease: object | None) -> None:
        """The save holding `lease` no longer reads the copy (a stale lease changes nothing)."""
        with self._lock:
            if lease is not None and self._lease is lease:
                self._lease = None


def layout(value: Any) -> Any:
    """The structure of a state dict, with each tensor's type, dtype and (local) shape: what a
    staged copy must match to be reused. (torch's own check copies every tensor to compare.)"""
    if isinstance(value, Mapping):
        return tuple((key, layout(item)) for key, item in value.items())
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(layout(item) for item in value))
    if isinstance(value, DTensor):
        local = value.to_local()
        return ("DTensor", value.dtype, tuple(value.shape), tuple(local.shape), value.placements)
    if torch.is_tensor(value):
        return ("Tensor", value.dtype, tuple(value.shape))
    return type(value).__name__


class Rank:
    """This process as a rank of its job: its Checkpointer, the restore annotation it follows,
    the staged copy of its async saves."""

    def __init__(
        self, checkpointer: client.Checkpointer, annotations: str | Path | None = None
    ) -> None:
        self.checkpointer = checkpointer  # job, rank, daemon, tiers, incarnation
        self.annotations = annotations  # the downward-API annotations file; None: none
        self.asked: restore.Restore | None = None  # the restore annotation followed
        self.loaded = False  # whether the step it names was loaded
        self.staged = StagedCopy()
        self._seen = ""  # the annotation's value followed

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Rank:
        env = os.environ if environ is None else environ
        return cls(client.Checkpointer.from_env(env), env.get(ANNOTATIONS_VARIABLE))

    def follow(self) -> restore.Restore | None:
        """The restore annotation; a value not followed yet starts its incarnation."""
        value = restore.read_annotations(self.annotations).get(restore.ANNOTATION, "")
        if value and value != self._seen:
            asked = restore.parse_restore(value)
            self._seen, self.asked, self.loaded = value, asked, False
            if asked is not None and asked.incarnation is not None:
                self.checkpointer.start_incarnation(asked.incarnation)
        return self.asked

    def also(self) -> tuple[str, ...]:
        """The daemons the restore annotation names, asked beside the node's and the peers."""
        return self.asked.sources if self.asked is not None else ()

    def incarnation_of(self, step: int) -> int | None:
        """The incarnation the annotation says wrote `step`; None: the newest holding it."""
        asked = self.asked
        return asked.of if asked is not None and asked.step == step else None

    def restored(self, point: manifest.Point) -> None:
        """`point` was loaded: the base of the next saves, and the annotation is served."""
        self.checkpointer.base = point.step
        asked = self.asked
        if asked is None or asked.step in (None, point.step):
            self.loaded = True


_THIS: Rank | None = None
_THIS_LOCK = threading.Lock()


def this_rank() -> Rank:
    """This process's rank, made from the pod's env at the first use."""
    global _THIS
    with _THIS_LOCK:
        if _THIS is None:
            _THIS = Rank.from_env()
        return _THIS


def latest(rank: Rank | None = None) -> str | None:
    """The checkpoint to load: str(step), or None to start from step 0 (module docstring)."""
    me = rank or this_rank()
    asked = me.follow()
    if asked is not None and not me.loaded:
        if asked.fresh:
            me.loaded = True
            return None
        if asked.step is not None:
            return str(asked.step)
    newest = _lowest_of_every_rank(me.checkpointer.copies(me.also()).newest())
    return None if newest is None else str(newest)


def _lowest_of_every_rank(step: int | None) -> int | None:
    """The lowest step any rank found (None when one found none), with a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return step
    found: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, step)
    steps = [s for s in found if s is not None]
    return min(steps) if len(steps) == len(found) else None


def _step_of(checkpoint_id: str | os.PathLike[str] | None) -> int:
    if checkpoint_id is None:
        raise ValueError("matrixpool_recovery.torch needs checkpoint_id=str(step) in dcp calls")
    return names.step(str(checkpoint_id))


def _entry(index: dcp_metadata.MetadataIndex) -> str:
    """The shard entry of a write item: its fully qualified name, and a chunk's offsets."""
    if index.offset is None:
        return f"{ITEM}{index.fqn}"
    return f"{ITEM}{index.fqn}@{','.join(str(o) for o in index.offset)}"


def _nbytes(value: Any) -> int:
    return len(value) if isinstance(value, bytes) else int(value.numel() * value.element_size())


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class StorageWriter(dcp_storage.StorageWriter, AsyncStager):
    """DCP's storage writer on the tiers (module docstring); `tiers` overrides the schedule
    (every configured tier, say, to answer a checkpoint request)."""

    _synchronize_after_execute = False  # stage() returns once the copy is made

    def __init__(self, *, tiers: Sequence[str] | None = None, rank: Rank | None = None) -> None:
        self._rank = rank  # None: this process's, from the env at the first use
        self.tiers = None if tiers is None else tuple(tiers)
        self.step = -1  # the checkpoint_id, as a step
        self.is_coordinator = False
        self._held: dict[str, Any] = {}  # the coordinator's items, saved by finish()
        self._lease: object | None = None  # of the staged copy this save reads

    @property
    def checkpoint_id(self) -> str:
        return str(self.step)

    def _me(self) -> Rank:
        return self._rank or this_rank()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.step = _step_of(checkpoint_id)
        self._held = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        me = self._me().checkpointer
        if self.step < 0:
            raise ValueError("matrixpool_recovery.torch needs checkpoint_id=str(step) in dcp calls")
        if kwargs.get("use_collectives") is False:
            raise ValueError("matrixpool_recovery.torch saves with collectives only")
        group_rank = kwargs.get("rank", me.rank)
        if group_rank != me.rank or is_coordinator != (me.rank == COORDINATOR):
            raise ValueError(
                f"process group rank {group_rank} (coordinator: {is_coordinator}) is not the "
                f"job's rank {me.rank} (MATRIXPOOL_RANK): save with the job's ranks"
            )
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> dcp_metadata.StorageMeta:
        return dcp_metadata.StorageMeta(checkpoint_id=self.checkpoint_id)

    def prepare_local_plan(self, plan: dcp_planner.SavePlan) -> dcp_planner.SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[dcp_planner.SavePlan]) -> list[dcp_planner.SavePlan]:
        return plans

    def write_data(
        self, plan: dcp_planner.SavePlan, planner: dcp_planner.SavePlanner
    ) -> Future[list[dcp_storage.WriteResult]]:
        """This rank's items as its shard; the coordinator's wait for the Metadata."""
        rank = self._me().checkpointer.rank
        state: dict[str, Any] = {}
        results = []
        for item in plan.items:
            name = _entry(item.index)
            data = planner.resolve_data(item)
            state[name] = data.getvalue() if isinstance(data, io.BytesIO) else data.detach()
            stored = Stored(rank, name)
            results.append(dcp_storage.WriteResult(item.index, _nbytes(state[name]), stored))
        if self.is_coordinator:
            self._held = state
        else:
            self._save(state)
        return _done(results)

    def finish(
        self, metadata: dcp_metadata.Metadata, results: list[list[dcp_storage.WriteResult]]
    ) -> None:
        """The coordinator's shard, the Metadata first: the checkpoint is whole once stored."""
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        state, self._held = {METADATA: _sealed(metadata), **self._held}, {}
        self._save(state)

    def _save(self, state: dict[str, Any]) -> None:
        """Save through the Checkpointer and wait for every tier due (raising failures)."""
        me = self._me().checkpointer
        tiers = self.tiers if self.tiers is not None else me.spec.due(self.step)
        try:
            handle = me.save(self.step, state, tiers=tiers, borrow=True)
            handle.wait_staged()
            self._release()
            handle.wait()
        except errors.TierWriteError as failed:
            if set(failed.failures) >= set(tiers):
                raise  # stored nowhere: the save failed
            # Stored on some tiers (the step counts there); a peer copy or a disk that failed
            # must not stop the training loop, as the Checkpointer's saves go on too.
            log.warning("step %d not stored on every tier: %s", self.step, failed)
        finally:
            self._release()

    # --- AsyncStager: what dcp.async_save calls in the training loop ---

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        me = self._me()
        staged, self._lease = me.staged.stage(state_dict)
        weakref.finalize(self, me.staged.release, self._lease)  # a save that failed early
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is made."""

    def close(self) -> None:
        """Nothing to free: the staged copy is the process's, for its next async save."""

    def _release(self) -> None:
        if self._lease is not None:
            self._me().staged.release(self._lease)
            self._lease = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).isdigit()


class StorageReader(dcp_storage.StorageReader):
    """DCP's storage reader on the tiers (module docstring)."""

    def __init__(self, *, rank: Rank | None = None) -> None:
        self._rank = rank  # None: this process's, from the env at the first use
        self.step = -1  # the checkpoint_id, as a step
        self.point: manifest.Point | None = None  # the step and the incarnation read
        self.storage_data: dict[Any, Stored] = {}  # from the Metadata
        self.sources: dict[int, str] = {}  # rank whose shard was read -> the copy read
        self.metadata_source = ""  # the copy of rank 0's shard the Metadata came from
        self._copies: client.Copies | None = None

    @property
    def checkpoint_id(self) -> str:
        return str(self.step)

    def _me(self) -> Rank:
        return self._rank or this_rank()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.step = _step_of(checkpoint_id)
        self.point, self._copies, self.sources = None, None, {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        copies, point = self._located()
        metadata, self.metadata_source = copies.read(COORDINATOR, point, _read_metadata)
        return metadata

    def set_up_storage_reader(
        self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: dcp_planner.LoadPlan) -> dcp_planner.LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[dcp_planner.LoadPlan]) -> list[dcp_planner.LoadPlan]:
        return plans

    def read_data(
        self, plan: dcp_planner.LoadPlan, planner: dcp_planner.LoadPlanner
    ) -> Future[None]:
        """Each shard that holds items of this rank's plan, own shard first, read once."""
        copies, point = self._located()
        me = self._me()
        by_rank: dict[int, list[dcp_planner.ReadItem]] = {}
        for item in plan.items:
            by_rank.setdefault(self.storage_data[item.storage_index].rank, []).append(item)
        for rank in sorted(by_rank, key=lambda r: (r != me.checkpointer.rank, r)):
            state, self.sources[rank] = copies.state(rank, point)
            for item in by_rank[rank]:
                _load(item, state[self.storage_data[item.storage_index].entry], planner)
            del state
        me.restored(point)
        return _done(None)

    def _located(self) -> tuple[client.Copies, manifest.Point]:
        """The copies of the job (looked up once per load) and the point read."""
        if self._copies is None or self.point is None:
            me = self._me()
            me.follow()
            copies = me.checkpointer.copies(me.also())
            found = copies.candidates(self.step, me.incarnation_of(self.step))
            if not found:
                lost = "; ".join(copies.unreachable) or "none"
                raise errors.NoCheckpointError(
                    f"{me.checkpointer.job}: no copy of step {self.step} found "
                    f"(unreachable daemons: {lost})"
                )
            self._copies, self.point = copies, found[0]
        return self._copies, self.point

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return str(checkpoint_id).isdigit()


def _sealed(metadata: dcp_metadata.Metadata) -> bytes:
    """The Metadata entry: its checksum, so that it can be read and checked alone."""
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    running = checksum.Running()
    running.update(data)
    return SEAL + running.value.encode() + b"\n" + data


def _read_metadata(stream: client.Stream) -> dcp_metadata.Metadata:
    """The Metadata from the start of rank 0's shard, checked against its own checksum."""
    entry = staging.read_entry(stream.read_into, METADATA)
    head, newline, data = entry.partition(b"\n")
    if not newline or not head.startswith(SEAL):
        raise errors.IntegrityError(f"the {METADATA} entry is not a sealed DCP Metadata")
    expected = head[len(SEAL) :].decode(errors="replace")
    running = checksum.Running(checksum.algorithm_of(expected))
    running.update(data)
    checksum.verify(expected, running, f"the {METADATA} entry")
    metadata = pickle.loads(data)  # the job's own bytes, as DCP's FileSystemReader reads them
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise errors.IntegrityError(f"the {METADATA} entry holds a {type(metadata).__name__}")
    return metadata


def _load(item: dcp_planner.ReadItem, value: Any, planner: dcp_planner.LoadPlanner) -> None:
    """One read item from a verified shard entry into the planner's target."""
    if item.type == dcp_planner.LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(value))
        return
    source = value
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
        source = source.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise errors.IntegrityError(
            f"{item.storage_index.fqn}: stored {tuple(source.size())} for a target of "
            f"{tuple(target.size())}"
        )
    target.copy_(source)
    planner.commit_tensor(item, target)
