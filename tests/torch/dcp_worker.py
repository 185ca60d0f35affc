"""One rank of a trainer that checkpoints with ``torch.distributed.checkpoint`` through
``matrixpool_recovery.torch``, exactly as the user contract is written (``latest``, then
``dcp.load``; ``dcp.save`` or ``dcp.async_save``). Run by tests/torch/test_dcp.py as
``python -m tests.torch.dcp_worker MODE ...``, one process per rank, with the pod's env and
torchrun's (env:// rendezvous on 127.0.0.1; ``conftest.Gang``). JSON lines on stdout.

Modes:
* ``plain --save S [--crash-at-finish S]`` saves a plain state dict (``plain_state``: a tensor
  every rank holds, which DCP stores once, a bfloat16 copy of it, one tensor per rank, a
  Python value) at each step S; ``plain --load`` loads what ``latest()`` names into a blank
  state and reports its digest (``plain_digest``) and where each shard came from. With
  ``--crash-at-finish S``, rank 0 dies in ``finish`` of step S: before storing its shard.
* ``train --model ddp|fsdp --until N --every K [--save-until M] [--async]`` trains a small MLP
  (DDP, or FSDP2's ``fully_shard`` on a CPU mesh) from what ``latest()`` names up to step N,
  saving every K steps up to step M (default N), and reports the parameters' digest: past M
  the run goes on fault-free, the reference of a run restored from M. Training is a function
  of (seed, step, rank): one thread, deterministic kernels, gloo's sums in a fixed order.
* ``async-check --flag PATH`` checks that ``dcp.async_save`` returns once the state is
  staged: rank 0 saves while rank 1 has not called it yet (so rank 0's save cannot get past
  its first collective), writes its parameters at once, and only then lets rank 1 save
  (PATH); the checkpoint must hold the staged values.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from matrixpool_recovery.torch import StorageReader, StorageWriter, latest

WIDTH = 128  # features of the MLP's layers
BATCH = 8  # samples per rank and step
FLAG_WAIT = 60.0  # seconds rank 1 waits for rank 0's flag


def report(**fields: Any) -> None:
    print(json.dumps({"rank": dist.get_rank(), **fields}), flush=True)


# --- a plain state dict ---------------------------------------------------------------------


def plain_state(step: int, rank: int) -> dict[str, Any]:
    """The state saved at ``step``: ``shared`` is the same on every rank (DCP stores it once,
    in one rank's shard), ``own<rank>`` is this rank's alone."""
    generator = torch.Generator().manual_seed(step)
    shared = torch.randn(256, 256, generator=generator)
    return {
        "shared": shared,
        "half": shared.to(torch.bfloat16),
        f"own{rank}": torch.full((1000,), float(step * 10 + rank)),
        "note": {"step": step, "words": ["saved", "by", "dcp"]},
    }


def plain_digest(state: dict[str, Any]) -> str:
    hasher = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        hasher.update(name.encode())
        if torch.is_tensor(value):
            hasher.update(str(value.dtype).encode())
            hasher.update(value.contiguous().view(torch.uint8).numpy().tobytes())
        else:
            hasher.update(json.dumps(value, sort_keys=True).encode())
    return hasher.hexdigest()


class CrashingWriter(StorageWriter):
    """Rank 0 dies in ``finish`` of one step, before its shard (and the Metadata) is stored."""

    def __init__(self, crash_at: int) -> None:
        super().__init__()
        self.crash_at = crash_at

    def finish(self, metadata: Any, results: Any) -> None:
        if self.step == self.crash_at:
            os._exit(17)
        super().finish(metadata, results)


def plain(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    for step in args.save:
        writer = CrashingWriter(args.crash_at_finish) if args.crash_at_finish else StorageWriter()
        dcp.save(plain_state(step, rank), checkpoint_id=str(step), storage_writer=writer)
        report(saved=step)
    if args.load:
        found = latest()
        report(latest=found)
        if found is not None:
            state = plain_state(0, rank)
            reader = StorageReader()
            dcp.load(state, checkpoint_id=found, storage_reader=reader)
            report(
                loaded=int(found),
                digest=plain_digest(state),
                sources={str(r): s for r, s in reader.sources.items()},
                metadata=reader.metadata_source,
            )


# --- training -------------------------------------------------------------------------------


def mlp(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH)
    )
    if kind == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(BATCH, WIDTH, generator=generator)
    return inputs, torch.tanh(torch.roll(inputs, 1, dims=1))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    inputs, targets = batch(step, dist.get_rank())
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


def app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_state, optimizer_state = dcp_state.get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def parameters_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the whole parameters (an FSDP model's gathered), the same on every rank."""
    options = dcp_state.StateDictOptions(full_state_dict=True)
    full = dcp_state.get_model_state_dict(model, options=options)
    hasher = hashlib.sha256()
    for name in sorted(full):
        hasher.update(name.encode())
        hasher.update(full[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step ``latest()`` names, loaded into the model and optimizer (0: none)."""
    found = latest()
    if found is None:
        report(restored=None)
        return 0
    state = app_state(model, optimizer)
    reader = StorageReader()
    dcp.load(state, checkpoint_id=found, storage_reader=reader)
    dcp_state.set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    sources = {str(r): s for r, s in reader.sources.items()}
    report(restored=int(found), sources=sources, metadata=reader.metadata_source)
    return int(found)


def train(args: argparse.Namespace) -> None:
    model = mlp(args.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = restore(model, optimizer)
    save_until = args.save_until or args.until
    saves = dist.new_group(backend="gloo")  # async saves' collectives, apart from training's
    pending: Any = None
    for step in range(start + 1, args.until + 1):
        train_step(model, optimizer, step)
        if step % args.every or step > save_until:
            continue
        if pending is not None:
            pending.result()
        began = time.perf_counter()
        state = app_state(model, optimizer)
        if args.asynchronous:
            pending = dcp.async_save(
                state, checkpoint_id=str(step), storage_writer=StorageWriter(), process_group=saves
            )
        else:
            dcp.save(state, checkpoint_id=str(step), storage_writer=StorageWriter())
        report(saved=step, seconds=time.perf_counter() - began)
    if pending is not None:
        pending.result()
    report(finished=args.until, digest=parameters_digest(model))


# --- async_save returns once staged ---------------------------------------------------------


def wait_for(flag: Path) -> None:
    deadline = time.monotonic() + FLAG_WAIT
    while not flag.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {flag} within {FLAG_WAIT}s")
        time.sleep(0.02)


def async_check(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    state = plain_state(2, rank)
    staged = plain_digest(state)
    if rank == 1:
        wait_for(args.flag)
    future = dcp.async_save(state, checkpoint_id="2", storage_writer=StorageWriter())
    pending = not future.done()  # rank 0: its save waits for rank 1's plan, not sent yet
    for value in state.values():
        if torch.is_tensor(value):
            value.add_(1)  # the training loop goes on at once
    if rank == 0:
        args.flag.touch()
    future.result()
    report(pending_at_return=pending, staged=staged, after=plain_digest(state))
    loaded = plain_state(0, rank)
    dcp.load(loaded, checkpoint_id=latest() or "none", storage_reader=StorageReader())
    report(loaded=plain_digest(loaded))


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dcp_worker")
    modes = parser.add_subparsers(dest="mode", required=True)
    plain_mode = modes.add_parser("plain")
    plain_mode.add_argument("--save", type=int, action="append", default=[])
    plain_mode.add_argument("--load", action="store_true")
    plain_mode.add_argument("--crash-at-finish", type=int, default=0)
    train_mode = modes.add_parser("train")
    train_mode.add_argument("--model", choices=("ddp", "fsdp"), required=True)
    train_mode.add_argument("--until", type=int, required=True)
    train_mode.add_argument("--every", type=int, required=True)
    train_mode.add_argument("--save-until", type=int, default=0)
    train_mode.add_argument("--async", dest="asynchronous", action="store_true")
    check_mode = modes.add_parser("async-check")
    check_mode.add_argument("--flag", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = arguments(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method="env://")
    try:
        {"plain": plain, "train": train, "async-check": async_check}[args.mode](args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
