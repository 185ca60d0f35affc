"""Fully sharded training (FSDP2's fully_shard) on CPU with gloo, checkpointed on matrixpool's
tiers through torch.distributed.checkpoint: each rank saves only its own shards, and a restore
reads whichever rank's data it needs, from that rank's daemon, its peer copy or tier 3. A
plain script: torch, torch.distributed (env://) and the three DCP calls, run as `torchrun
fsdp.py` in every rank's pod (the pod gives torchrun its PET_* environment).

Knobs (env): STEPS (200), SAVE_EVERY (10; 0 saves nothing), ASYNC (1: dcp.async_save, the
loop stalls only for the staging copy), STEP_SECONDS (0), WIDTH (256), SEED (0). One JSON line
per step; at the end {"finished": true, "digest": <SHA-256 of the gathered parameters>}.
"""

import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from matrixpool_recovery.torch import StorageReader, StorageWriter, latest


def knob(name: str, default: str) -> str:
    return os.environ.get(name) or default


def main() -> None:
    steps, every = int(knob("STEPS", "200")), int(knob("SAVE_EVERY", "10"))
    asynchronous = knob("ASYNC", "1") == "1"
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
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width)
    )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    saves = dist.new_group(backend="gloo")  # async saves talk apart from the training's collectives

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

    pending = None
    while step < steps:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step * world + rank)
        inputs = torch.randn(16, width, generator=generator)
        loss = torch.nn.functional.mse_loss(model(inputs), torch.tanh(inputs.roll(1, dims=1)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if every and step % every == 0:
            if pending is not None:
                pending.result()  # one save in flight at a time
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            if asynchronous:
                pending = dcp.async_save(
                    state,
                    checkpoint_id=str(step),
                    storage_writer=StorageWriter(),
                    process_group=saves,
                )
            else:
                dcp.save(state, checkpoint_id=str(step), storage_writer=StorageWriter())
        print(json.dumps({"rank": rank, "step": step, "loss": loss.item()}), flush=True)
        time.sleep(pause)
    if pending is not None:
        pending.result()

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for name, tensor in sorted(full.items()):
        digest.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
    print(
        json.dumps({"rank": rank, "finished": True, "step": step, "digest": digest.hexdigest()}),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
