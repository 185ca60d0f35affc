"""Smoke test of the matrixpool image's torch, on CPU with gloo.

tools/image/build.sh runs it inside the built image (a read-only overlay of its layers, chroot,
uid 65532, tmpfs /tmp) after every build, and fails the build when it fails:

    python smoke.py

1. ``import torch``: PyPI's torch of the image venv, at the version pinned in
   tools/torch-venv.sh (``--expect-version``), and the libraries it loads present;
2. a 2-process gloo ``all_reduce`` started by ``torch.multiprocessing.spawn``
   (MASTER_ADDR=127.0.0.1, a free port);
3. ``torchrun --nnodes 1 --nproc-per-node 2`` over this file (``worker``), whose ranks build an
   FSDP2 model (``fully_shard`` over a CPU device mesh), step it once, save model and optimizer
   (``get_state_dict``) with ``dcp.save(checkpoint_id=..., storage_writer=FileSystemWriter)``
   and ``dcp.async_save``, load both into a fresh model (``FileSystemReader``,
   ``set_state_dict``) and compare every parameter.

Any failed check raises (exit status non-zero). Needs no network beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def all_reduce(rank: int, world: int, port: int) -> None:
    """One rank of the spawned gloo group: the sum of 1..world, everywhere."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        want = world * (world + 1) / 2
        if t.item() != want:
            raise AssertionError(f"rank {rank}: all_reduce gave {t.item()}, want {want}")
    finally:
        dist.destroy_process_group()


def model(mesh: Any, seed: int) -> nn.Module:
    """A small MLP sharded by FSDP2 over ``mesh``: each Linear, then the root."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def full(m: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (DTensor.full_tensor; a collective)."""
    return {name: p.full_tensor().detach().clone() for name, p in m.named_parameters()}


def worker(root: Path) -> None:
    """One torchrun rank: FSDP2 step, DCP save / async_save, load into a fresh model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2 or os.environ.get("LOCAL_WORLD_SIZE") != "2":
        raise AssertionError(f"torchrun started {world} ranks, want 2")
    mesh = init_device_mesh("cpu", (world,))
    trained = model(mesh, seed=0)
    if not all(isinstance(p, DTensor) for p in trained.parameters()):
        raise AssertionError("fully_shard left a parameter that is not a DTensor")
    opt = torch.optim.AdamW(trained.parameters(), lr=0.1)
    before = full(trained)
    torch.manual_seed(1 + rank)
    trained(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()
    after = full(trained)
    if all(torch.equal(before[k], after[k]) for k in before):
        raise AssertionError("one FSDP2 step changed no parameter")

    msd, osd = get_state_dict(trained, opt)
    state = {"model": msd, "optim": osd}
    sync_dir, async_dir = str(root / "sync"), str(root / "async")
    dcp.save(state, checkpoint_id=sync_dir, storage_writer=dcp.FileSystemWriter(sync_dir))
    pending = dcp.async_save(
        state, checkpoint_id=async_dir, storage_writer=dcp.FileSystemWriter(async_dir)
    )
    pending.result(timeout=TIMEOUT.total_seconds())

    for where in (sync_dir, async_dir):
        fresh = model(mesh, seed=2)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        # One step so that the optimizer has state for dcp.load to fill in.
        fresh(torch.randn(4, 8)).sum().backward()
        fresh_opt.step()
        fresh_opt.zero_grad()
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        loaded = {"model": fmsd, "optim": fosd}
        dcp.load(loaded, checkpoint_id=where, storage_reader=dcp.FileSystemReader(where))
        set_state_dict(
            fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        got = full(fresh)
        for k, want in after.items():
            if not torch.equal(got[k], want):
                raise AssertionError(f"{where}: {k} differs after dcp.load")
    dist.barrier()
    dist.destroy_process_group()
    print(f"smoke worker {rank}: every check passed", file=sys.stderr, flush=True)
    # Every check passed. Leave without the interpreter's teardown: torch 2.15 now and then
    # aborts there ("terminate called without an active exception", a native thread still
    # joinable), which says nothing about the image.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect-version", help="torch.__version__ must be this")
    parser.add_argument("--expect-prefix", help="torch must be imported from under this folder")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("worker").add_argument("root", type=Path)
    args = parser.parse_args()
    if args.command == "worker":
        worker(args.root)
        return

    started = time.monotonic()

    def say(what: str) -> None:
        print(f"smoke {time.monotonic() - started:5.1f}s: {what}", file=sys.stderr)

    version = torch.__version__
    if args.expect_version and version.split("+")[0] != args.expect_version:
        raise AssertionError(f"torch {version}, want {args.expect_version}")
    if args.expect_prefix and not torch.__file__.startswith(args.expect_prefix):
        raise AssertionError(f"torch from {torch.__file__}, want under {args.expect_prefix}")
    if not dist.is_gloo_available():
        raise AssertionError("this torch has no gloo")
    say(f"import torch {version} from {Path(torch.__file__).parent}")

    mp.spawn(all_reduce, args=(2, free_port()), nprocs=2, join=True)
    say("gloo all_reduce over 2 processes (torch.multiprocessing.spawn)")

    torchrun = Path(sys.executable).parent / "torchrun"
    with tempfile.TemporaryDirectory(prefix="smoke-") as root:
        command = [
            str(torchrun),
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            __file__,
            "worker",
            root,
        ]
        done = subprocess.run(command, timeout=180, check=False)
        if done.returncode != 0:
            raise SystemExit(f"smoke: {' '.join(command)} exited {done.returncode}")
        for kind in ("sync", "async"):
            if not (Path(root) / kind / ".metadata").is_file():
                raise AssertionError(f"dcp wrote no {kind}/.metadata")
    say("torchrun 2 ranks: FSDP2 fully_shard step, dcp.save, dcp.async_save, dcp.load")


if __name__ == "__main__":
    main()
