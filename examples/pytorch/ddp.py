"""Data-parallel training (DDP) on CPU with gloo, checkpointed on matrixpool's tiers through
torch.distributed.checkpoint. A plain script: torch, torch.distributed (env://) and the three
DCP calls; the TrainingJob's pod gives torchrun its PET_* environment, so `torchrun ddp.py`
needs no flags, and matrixpool_recovery.torch finds the job, the rank and the node's
checkpoint daemon in the pod.

Knobs (env): STEPS (200), SAVE_EVERY (10; 0 saves nothing), STEP_SECONDS (0), WIDTH (256),
SEED (0). One JSON line per step; at the end {"finished": true, "digest": <SHA-256 of the
parameters>}: training is a function of (SEED, step, rank), so a run that was stopped and
restored ends with the digest of one that never was.
"""

import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from matrixpool_recovery.torch import StorageReader, StorageWriter, latest


def knob(name: str, default: str) -> str:
    return os.environ.get(name) or default


def main() -> None:
    steps, every = int(knob("STEPS", "200")), int(knob("SAVE_EVERY", "10"))
    pause, width, seed = (
        float(knob("STEP_SECONDS", "0")),
        int(knob("WIDTH", "256")),
        int(knob("SEED", "0")),
    )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    layers = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width)
    )
    model = DistributedDataParallel(layers)
    # DDP lays its gradient buckets out again after its first backward pass; a run restarted
    # from a checkpoint would sum the gradients of its first step in another order than a
    # run that never stopped (equal to rounding, not bitwise). One pass on zeros, the same
    # in every run, settles the layout first: every step of every run sums alike.
    model(torch.zeros(1, width)).sum().backward()
    model.zero_grad(set_to_none=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    step = 0
    found = latest() if every else None  # the newest step every rank committed, or None
    if found is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=found, storage_reader=StorageReader())
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        step = int(found)
        print(json.dumps({"rank": rank, "restored": step}), flush=True)

    while step < steps:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * world + rank)
        inputs = torch.randn(16, width, generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs), torch.tanh(inputs.roll(1, dims=1)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if every and step % every == 0:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            dcp.save(state, checkpoint_id=str(step), storage_writer=StorageWriter())
        print(json.dumps({"rank": rank, "step": step, "loss": loss.item()}), flush=True)
        time.sleep(pause)

    digest = hashlib.sha256()
    for name, tensor in sorted(model.module.state_dict().items()):
        digest.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
    print(
        json.dumps({"rank": rank, "finished": True, "step": step, "digest": digest.hexdigest()}),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
