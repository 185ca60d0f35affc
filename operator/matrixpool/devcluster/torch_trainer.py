"""A real PyTorch trainer rank: a small MLP trained on CPU with gloo, checkpointed through the
real :class:`~matrixpool_recovery.client.Checkpointer`, restored bitwise.

``python -m matrixpool.devcluster.torch_trainer``, with the pod contract of
:mod:`matrixpool.devcluster.trainer` (docs/concepts.md, "What your training container gets";
the annotations file, the restore and checkpoint-request annotations, ``MATRIXPOOL_SIM_STEPS``)
and its helpers; run by tests/torch as two rank processes with that env set by hand. Needs
torch (PyPI's torch 2.15: ``tools/torch-venv.sh`` makes ``.venv-torch``).

Training is a pure function of (seed, step, rank), so a run that was killed and restored ends
with the parameters of a run that never was (``reference_digest`` computes those in-process):
* the model (``MATRIXPOOL_TORCH_WIDTH``, default 1024: two width x width layers, 8 MB) is
  initialised from ``MATRIXPOOL_TORCH_SEED``; each step's batch comes from (seed, step, rank);
* one thread, deterministic algorithms;
* gradients are all-gathered and summed in rank order (``average``), never all-reduced: a
  ring all-reduce adds in an order of its own, the in-process reference could not repeat it;
* Adam's state (moments, step counters) is checkpointed with the parameters (``state_of``).

What a rank does:
1. It joins its gang through a ``FileStore`` in ``MATRIXPOOL_TORCH_RENDEZVOUS`` (a folder all
   ranks share; default ``<tier-3 path>/<job>/torch-rendezvous`` when this rank may write
   there, else the machine's temporary folder), one file per job, incarnation and recovery,
   so a new incarnation never meets the ranks of the old one.
2. It restores what the restore annotation names (model tensors filled in place), else starts
   from step 0; ranks told "the newest" agree on the lowest step any of them found.
3. Each step: gradient of its batch, all-gather, Adam step, save as the job's spec says
   (``MATRIXPOOL_SIM_STEP_SECONDS``, default 0, slows steps down for tests that kill ranks).
   Between steps it answers checkpoint requests (the first rank to see one picks the step,
   through the store) and reloads on a new restore annotation.
4. A collective that fails (a rank died: gloo sees its sockets close) stops the step; the rank
   waits for the restore annotation of the recovery (``MATRIXPOOL_TORCH_TIMEOUT_SECONDS``,
   default 300), leaves the broken group and joins the new incarnation's, as the operator's
   InPlace recovery expects of surviving ranks; without one it exits 1 (its pod fails).
5. Once ``MATRIXPOOL_SIM_STEPS`` is reached it prints ``{"finished": true, "digest": ...}``
   (SHA-256 of every parameter) and exits 0.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import torch
import torch.distributed as dist

from matrixpool import clock
from matrixpool.api import labels
from matrixpool.devcluster import trainer
from matrixpool_recovery import client, errors
from matrixpool_recovery import restore as restore_codec

RENDEZVOUS_VARIABLE = "MATRIXPOOL_TORCH_RENDEZVOUS"  # folder of the gang's FileStores
WIDTH_VARIABLE = "MATRIXPOOL_TORCH_WIDTH"  # features of the MLP's layers
SEED_VARIABLE = "MATRIXPOOL_TORCH_SEED"  # initial weights and every batch
TIMEOUT_VARIABLE = "MATRIXPOOL_TORCH_TIMEOUT_SECONDS"  # rendezvous, collectives, recovery wait
PAUSE_VARIABLE = "MATRIXPOOL_SIM_STEP_SECONDS"  # extra seconds per step (the sim's knob), 0
BATCH = 16  # samples per rank and step
LEARNING_RATE = 1e-3
MODEL, OPTIMIZER = "model/", "optimizer/"  # prefixes of the checkpointed names
POLL_SECONDS = 0.05  # annotations file, while waiting for a recovery


@dataclass(frozen=True)
class Settings:
    """The run's knobs from the env: seed and width fix its numbers, timeout bounds waits."""

    seed: int = 0  # initial weights and batches
    width: int = 1024  # features of each layer
    timeout: float = 300.0  # seconds for the rendezvous, a collective, a recovery

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        return cls(
            int(env.get(SEED_VARIABLE) or 0),
            int(env.get(WIDTH_VARIABLE) or 1024),
            float(env.get(TIMEOUT_VARIABLE) or 300),
        )


# --- the training, a pure function of (seed, step, rank) ---------------------------------------


@contextmanager
def deterministic() -> Iterator[None]:
    """One thread and deterministic kernels: the same bits in every process (restored after)."""
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(strict)


def model_for(settings: Settings) -> Any:
    torch.manual_seed(settings.seed)
    width = settings.width
    return torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width)
    )


def optimizer_for(model: Any) -> Any:
    return torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)


def batch(settings: Settings, step: int, rank: int) -> tuple[Any, Any]:
    """Inputs and targets of ``rank`` at ``step``: the target is a fixed function of x."""
    key = hashlib.blake2b(f"{settings.seed}/{step}/{rank}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    inputs = torch.randn(BATCH, settings.width, generator=generator)
    return inputs, torch.tanh(torch.roll(inputs, 1, dims=1))


def local_gradient(model: Any, settings: Settings, step: int, rank: int) -> tuple[Any, float]:
    """This rank's gradient at ``step`` (the step being made: 1 for the first), flat."""
    model.zero_grad(set_to_none=True)
    inputs, targets = batch(settings, step, rank)
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return flat, float(loss)


def average(gradients: Sequence[Any]) -> Any:
    """The ranks' gradients summed in rank order, then divided: the same bits everywhere."""
    total = gradients[0].clone()
    for gradient in gradients[1:]:
        total.add_(gradient)
    return total.div_(len(gradients))


def apply(model: Any, optimizer: Any, gradient: Any) -> None:
    offset = 0
    for parameter in model.parameters():
        count = parameter.numel()
        parameter.grad = gradient[offset : offset + count].view_as(parameter).clone()
        offset += count
    optimizer.step()


def digest(model: Any) -> str:
    """SHA-256 of every parameter's name and bytes, in the model's order."""
    hasher = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        hasher.update(name.encode())
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()


def reference_digest(steps: int, world_size: int, settings: Settings | None = None) -> str:
    """The parameters' digest after ``steps`` fault-free steps of ``world_size`` ranks,
    computed in this process: the ranks' gradients one after the other, as one replica."""
    settings = settings or Settings()
    with deterministic():
        model = model_for(settings)
        optimizer = optimizer_for(model)
        for step in range(1, steps + 1):
            gradients = [local_gradient(model, settings, step, r)[0] for r in range(world_size)]
            apply(model, optimizer, average(gradients))
        return digest(model)


# --- checkpointed state: names -> tensors and bytes -------------------------------------------


def state_of(step: int, model: Any, optimizer: Any) -> dict[str, Any]:
    """Model and optimizer as the Checkpointer's mapping: tensors by name, the rest as JSON."""
    state: dict[str, Any] = {f"{MODEL}{k}": v for k, v in model.state_dict().items()}
    saved = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in saved["state"].items():
        for key, value in values.items():
            if torch.is_tensor(value):
                state[f"{OPTIMIZER}state/{index}/{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    meta = {"param_groups": saved["param_groups"], "scalars": scalars}
    state[f"{OPTIMIZER}meta"] = json.dumps(meta, sort_keys=True).encode()
    state["trainer/step"] = torch.tensor(step, dtype=torch.int64)
    return state


def load(model: Any, optimizer: Any, state: Mapping[str, Any]) -> int:
    """Put a restored state back (model tensors may already be the restored ones); its step."""
    model.load_state_dict({k[len(MODEL) :]: v for k, v in state.items() if k.startswith(MODEL)})
    meta = json.loads(bytes(state[f"{OPTIMIZER}meta"]))
    per_parameter: dict[int, dict[str, Any]] = {}
    for index, values in meta["scalars"].items():
        per_parameter.setdefault(int(index), {}).update(values)
    prefix = f"{OPTIMIZER}state/"
    for name, value in state.items():
        if name.startswith(prefix):
            index, key = name[len(prefix) :].split("/", 1)
            per_parameter.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": per_parameter, "param_groups": meta["param_groups"]})
    return int(state["trainer/step"])


# --- the gang: a gloo process group per incarnation -------------------------------------------


def rendezvous_folder(env: Mapping[str, str], job: str, persistent_uri: str | None) -> Path:
    """Where the gang's FileStores go: the env's folder, a writable tier 3, or /tmp."""
    if named := env.get(RENDEZVOUS_VARIABLE):
        return Path(named)
    if persistent_uri and persistent_uri.startswith("file://"):
        root = Path(unquote(urlsplit(persistent_uri).path))
        if root.is_dir() and os.access(root, os.W_OK):
            return root / job / "torch-rendezvous"
    return Path(tempfile.gettempdir()) / "matrixpool-torch-rendezvous"


class Gang:
    """This rank's gloo process group, joined once per incarnation (and recovery)."""

    def __init__(self, folder: Path, job: str, rank: int, world_size: int, timeout: float) -> None:
        self.folder, self.job, self.rank, self.world_size = folder, job, rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout)  # rendezvous and each collective
        self.store: Any = None  # the FileStore of the group joined; None: none

    def join(self, incarnation: int, recovery: str = "") -> None:
        self.leave()
        self.folder.mkdir(parents=True, exist_ok=True)
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", recovery)
        path = self.folder / f"{self.job}.{incarnation}{'.' + tag if tag else ''}.store"
        self.store = dist.FileStore(str(path), self.world_size)
        dist.init_process_group(
            "gloo",
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )

    def leave(self) -> None:
        if self.store is not None:
            dist.destroy_process_group()
            self.store = None

    def gather(self, flat: Any) -> list[Any]:
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        return parts

    def lowest(self, step: int) -> int:
        value = torch.tensor([step], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return int(value)

    def answer_step(self, request: str, proposal: int) -> int:
        """The step every rank saves to answer ``request``: the first rank's proposal."""
        key = f"matrixpool/answer/{request}"
        if self.store.add(key, 1) == 1:
            self.store.set(f"{key}/step", str(proposal))
        return int(self.store.get(f"{key}/step"))


# --- one rank ---------------------------------------------------------------------------------


class BrokenGangError(Exception):
    """A collective failed: a rank of the gang is gone."""


class TorchTrainer:
    """One rank's loop: train, save, follow the pod's annotations, recover in place."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.settings = Settings.from_env(env)
        self.checkpointer = client.Checkpointer.from_env(env)
        ckpt = self.checkpointer
        self.rank, self.job, self.world_size = ckpt.rank, ckpt.job, ckpt.world_size
        self.steps = int(env.get(trainer.STEPS_VARIABLE) or 0)  # the last step; 0: forever
        self.pause = float(env.get(PAUSE_VARIABLE) or 0)  # seconds slept per step
        self.annotations_file = env.get("MATRIXPOOL_ANNOTATIONS_FILE")
        folder = rendezvous_folder(env, self.job, ckpt.spec.persistent_uri)
        self.gang = Gang(folder, self.job, self.rank, self.world_size, self.settings.timeout)
        seen = trainer.read_annotations(self.annotations_file)
        self.restore_seen = seen.get(labels.RESTORE, "")
        self.request_seen = seen.get(labels.CHECKPOINT_REQUEST, "")
        self.answer_at: tuple[str, int] | None = None  # (request, step) to save on every tier
        self.model = model_for(self.settings)
        self.optimizer = optimizer_for(self.model)
        self.step = self.start(self.restore_seen)

    def run(self) -> None:
        try:
            while not 0 < self.steps <= self.step:
                try:
                    loss = self.train_step()
                except BrokenGangError as broken:
                    trainer.report(rank=self.rank, step=self.step, broken=str(broken))
                    self.await_restore()
                    continue
                self.save(self.step, loss)
                self.follow_annotations()
            trainer.report(rank=self.rank, step=self.step, finished=True, digest=digest(self.model))
        finally:
            self.checkpointer.close()
            self.gang.leave()

    def train_step(self) -> float:
        step = self.step + 1
        time.sleep(self.pause)
        flat, loss = local_gradient(self.model, self.settings, step, self.rank)
        try:
            gradients = self.gang.gather(flat)
        except RuntimeError as err:  # gloo: a peer's sockets closed, or the timeout passed
            raise BrokenGangError(str(err)) from err
        apply(self.model, self.optimizer, average(gradients))
        self.step = step
        return loss

    def save(self, step: int, loss: float) -> None:
        state = state_of(step, self.model, self.optimizer)  # copied at capture: see staging
        if self.answer_at is not None and step >= self.answer_at[1]:
            request, _ = self.answer_at
            self.answer_at = None
            tiers = self.checkpointer.spec.configured()
            self.checkpointer.save(step, state, tiers=tiers).done.wait()
            trainer.report(rank=self.rank, step=step, loss=loss, answered=request)
            return
        self.checkpointer.save(step, state)
        trainer.report(rank=self.rank, step=step, loss=loss)

    def follow_annotations(self) -> None:
        """Answer a new checkpoint request; reload on a new restore."""
        seen = trainer.read_annotations(self.annotations_file)
        request = seen.get(labels.CHECKPOINT_REQUEST, "")
        if request and request != self.request_seen:
            self.request_seen = request
            # Ranks are at most one step apart (each step gathers): both can make step + 2.
            self.answer_at = (request, self.gang.answer_step(request, self.step + 2))
        restore = seen.get(labels.RESTORE, "")
        if restore and restore != self.restore_seen:
            self.reload(restore)

    def await_restore(self) -> None:
        """After a broken collective: wait for the recovery's restore annotation, or exit 1."""
        deadline = clock.SYSTEM.monotonic() + self.settings.timeout
        while clock.SYSTEM.monotonic() < deadline:
            restore = trainer.read_annotations(self.annotations_file).get(labels.RESTORE, "")
            if restore and restore != self.restore_seen:
                self.reload(restore)
                return
            time.sleep(POLL_SECONDS)
        trainer.report(rank=self.rank, step=self.step, error="no recovery came: exiting")
        raise SystemExit(1)

    def reload(self, where: str) -> None:
        self.restore_seen = where
        self.answer_at = None
        self.gang.leave()
        self.step = self.start(where)

    def start(self, where: str) -> int:
        """Join the gang of the run the annotation names and restore; the step to go on from."""
        asked = restore_codec.parse_restore(where)
        if asked is not None and asked.incarnation is not None:
            self.checkpointer.start_incarnation(asked.incarnation)
        self.gang.join(self.checkpointer.incarnation, asked.recovery if asked else "")
        if asked is None or asked.fresh:  # step 0: the initial weights, a new optimizer
            self.model.load_state_dict(model_for(self.settings).state_dict())
            self.optimizer = optimizer_for(self.model)
            fresh = {"fresh": True, "recovery": asked.recovery} if asked else {}
            trainer.report(rank=self.rank, step=0, restored=None, **fresh)
            return 0
        restored = self.read(asked)
        step = restored.step if asked.step is not None else self.gang.lowest(restored.step)
        if step != restored.step:  # another rank found an older newest step
            restored = self.read(restore_codec.Restore(step, asked.sources, of=asked.of))
        self.checkpointer.base = load(self.model, self.optimizer, restored.state)
        trainer.report(
            rank=self.rank,
            step=restored.step,
            restored=restored.step,
            source=restored.source,
            recovery=asked.recovery,
            skipped=list(restored.skipped),
        )
        return restored.step

    def read(self, asked: restore_codec.Restore) -> client.Restored:
        """This rank's shard of the step asked for, model tensors filled in place. As the
        simulated trainer does: a reader of its own (saves in flight must not hold it up),
        first from the daemons the operator named, then from every peer."""
        peers = self.env.get("MATRIXPOOL_CKPT_PEERS", "").split(",")
        narrow = ",".join(asked.sources)
        wide = ",".join(dict.fromkeys(p for p in [*peers, *asked.sources] if p))
        attempts = [narrow, wide] if asked.step is not None else [wide]
        into = {f"{MODEL}{k}": v for k, v in self.model.state_dict().items()}
        for index, listed in enumerate(attempts):
            reader = client.Checkpointer.from_env({**self.env, "MATRIXPOOL_CKPT_PEERS": listed})
            try:
                return reader.restore(asked.step, incarnation=asked.of, into=into)
            except errors.NoCheckpointError:
                if index == len(attempts) - 1:
                    raise
            finally:
                reader.close()
        raise AssertionError("unreachable: the last attempt returns or raises")


def main() -> int:
    with deterministic():
        TorchTrainer(os.environ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
