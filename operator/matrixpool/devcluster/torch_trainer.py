"""A real PyTorch trainer rank: a small MLP trained on CPU with gloo, on the path a user's job
takes: torchrun's rendezvous env and ``torch.distributed.checkpoint`` (DCP) through
:mod:`matrixpool_recovery.torch`, restored bitwise.

``python -m matrixpool.devcluster.torch_trainer``, with the pod contract of
:mod:`matrixpool.devcluster.trainer` (docs/concepts.md, "What your training container gets";
the annotations file, the restore and checkpoint-request annotations, ``MATRIXPOOL_SIM_STEPS``)
and its helpers, plus torchrun's variables the operator writes into every rank's pod
(``MASTER_ADDR``: rank 0's DNS name, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); run by
tests/torch as two rank processes with that env set by hand. Needs torch (PyPI's torch 2.15:
``tools/torch-venv.sh`` makes ``.venv-torch``).

Training is a pure function of (seed, step, rank), so a run that was killed and restored ends
with the parameters of a run that never was (``reference_digest`` computes those in-process):
* the model (``MATRIXPOOL_TORCH_WIDTH``, default 1024: two width x width layers, 8 MB) is
  initialised from ``MATRIXPOOL_TORCH_SEED``; each step's batch comes from (seed, step, rank);
* one thread, deterministic algorithms;
* gradients are all-gathered and summed in rank order (``average``), never all-reduced: a
  ring all-reduce adds in an order of its own, the in-process reference could not repeat it;
* Adam's state (moments, step counters) is checkpointed with the parameters (``state_of``).

What a rank does:
1. It joins its gang through a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``: rank 0 serves it
   for the life of its process (a surviving rank 0 keeps serving across recoveries), every
   other rank connects anew at each join (resolving ``MASTER_ADDR`` again: after a recovery
   rank 0 may be a new process on another node under the same name), retrying until the
   timeout. Each join (incarnation and recovery) uses keys under a prefix of its own, so a
   new incarnation never meets the old one's.
2. It loads what ``latest()`` names (``dcp.load`` with a ``StorageReader``: the step the
   restore annotation names, read from the daemons it names, the node's, the peers and tier
   3; "fresh": none; no annotation or "the newest": the newest step every rank committed,
   the lowest any rank found), else starts from step 0.
3. Each step: gradient of its batch, all-gather, Adam step; at a step the job's spec makes
   due on some tier, every rank calls ``dcp.save`` with a ``StorageWriter``, which returns
   once those tiers answered (``MATRIXPOOL_SIM_STEP_SECONDS``, default 0, slows steps down
   for tests that kill ranks). Between steps it answers checkpoint requests (the first rank
   to see one picks the step and publishes it through the store, so every rank saves that
   step, on every configured tier, whenever its own annotation shows the request) and
   reloads on a new restore annotation.
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
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.checkpoint.api import CheckpointException

from matrixpool import clock
from matrixpool.api import labels
from matrixpool.devcluster import trainer
from matrixpool_recovery import torch as recovery_torch

WIDTH_VARIABLE = "MATRIXPOOL_TORCH_WIDTH"  # features of the MLP's layers
SEED_VARIABLE = "MATRIXPOOL_TORCH_SEED"  # initial weights and every batch
TIMEOUT_VARIABLE = "MATRIXPOOL_TORCH_TIMEOUT_SECONDS"  # rendezvous, collectives, recovery wait
PAUSE_VARIABLE = "MATRIXPOOL_SIM_STEP_SECONDS"  # extra seconds per step (the sim's knob), 0
MASTER_PORT = 29500  # torchrun's default, when the env names none
BATCH = 16  # samples per rank and step
LEARNING_RATE = 1e-3
POLL_SECONDS = 0.05  # annotations file, while waiting for a recovery
CONNECT_RETRY_SECONDS = 1.0  # between tries to reach rank 0's store
ANSWERS = "matrixpool/answers"  # store counter of the checkpoint requests published


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


def reference_digest(
    steps: int,
    world_size: int,
    settings: Settings | None = None,
    regroups: Sequence[tuple[int, int]] = (),
) -> str:
    """The parameters' digest after ``steps`` fault-free steps of ``world_size`` ranks,
    computed in this process: the ranks' gradients one after the other, as one replica.
    ``regroups``: (step restored, new world size) of each regroup, in order — the steps after
    one are made by that many ranks (an elastic job shrunk or grown: docs/concepts.md)."""
    settings = settings or Settings()
    with deterministic():
        model = model_for(settings)
        optimizer = optimizer_for(model)
        for step in range(1, steps + 1):
            world = world_size
            for restored, size in regroups:
                if step > restored:
                    world = size
            gradients = [local_gradient(model, settings, step, r)[0] for r in range(world)]
            apply(model, optimizer, average(gradients))
        return digest(model)


# --- checkpointed state: what dcp.save and dcp.load see ---------------------------------------


def state_of(model: Any, optimizer: Any) -> dict[str, Any]:
    """Model and optimizer as DCP's state dict (``get_state_dict``, as the examples do): the
    model's own tensors, Adam's moments and step counters (made, at zero, for an optimizer that
    has not stepped yet, so that a load has tensors to fill)."""
    model_state, optimizer_state = dcp_state.get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load(model: Any, optimizer: Any, state: Mapping[str, Any]) -> None:
    """Put a loaded ``state_of`` back into the model and the optimizer."""
    dcp_state.set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


# --- the gang: a gloo process group per incarnation -------------------------------------------


@dataclass(frozen=True)
class Master:
    """Where rank 0's store is, from torchrun's env (the operator's ``pods.Rendezvous``)."""

    address: str  # MASTER_ADDR: rank 0's DNS name, the same after any recovery
    port: int  # MASTER_PORT

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int, world_size: int) -> Master:
        """MASTER_ADDR and MASTER_PORT; RANK and WORLD_SIZE, where set, must be the job's."""
        address = env.get("MASTER_ADDR")
        if not address:
            raise ValueError(
                "MASTER_ADDR is not set: the trainer finds rank 0's store at "
                "MASTER_ADDR:MASTER_PORT, which the operator writes into every rank's pod"
            )
        for name, job_value in (("RANK", rank), ("WORLD_SIZE", world_size)):
            given = env.get(name)
            if given is not None and int(given) != job_value:
                raise ValueError(
                    f"{name}={given} is not the job's {job_value} (MATRIXPOOL_{name}): this "
                    "trainer runs one process per pod (spec.rendezvous.procsPerReplica 1)"
                )
        return cls(address, int(env.get("MASTER_PORT") or MASTER_PORT))


class Gang:
    """This rank's gloo process group, joined once per incarnation (and recovery) through
    rank 0's ``TCPStore``, under a key prefix of its own."""

    def __init__(self, master: Master, rank: int, world_size: int, timeout: float) -> None:
        self.master, self.rank, self.world_size = master, rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout)  # rendezvous and each collective
        self.server: Any = None  # rank 0's TCPStore: made once, served for the process's life
        self.store: Any = None  # the PrefixStore of the group joined; None: none
        self.answers_read = 0  # checkpoint requests of this group's store already read

    def join(self, incarnation: int, recovery: str = "") -> None:
        self.leave()
        self.store = dist.PrefixStore(f"{incarnation}.{recovery}", self.connect())
        self.answers_read = 0
        dist.init_process_group(
            "gloo",
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )

    def connect(self) -> Any:
        """Rank 0's store: served here on rank 0, a new client anywhere else (the name
        resolved again, tries repeated until the timeout: rank 0 may be starting up)."""
        address, port = self.master.address, self.master.port
        if self.rank == 0:
            if self.server is None:
                self.server = dist.TCPStore(
                    address, port, is_master=True, timeout=self.timeout, wait_for_workers=False
                )
            return self.server
        deadline = clock.SYSTEM.monotonic() + self.timeout.total_seconds()
        while True:
            left = deadline - clock.SYSTEM.monotonic()
            try:
                return dist.TCPStore(
                    address,
                    port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=max(left, 1.0)),
                    wait_for_workers=False,
                )
            except RuntimeError as err:  # DistNetworkError: not resolved, refused, timed out
                if clock.SYSTEM.monotonic() + CONNECT_RETRY_SECONDS >= deadline:
                    raise RuntimeError(
                        f"rank 0's store at {address}:{port} (MASTER_ADDR:MASTER_PORT) was not "
                        f"reached within {self.timeout.total_seconds():g}s: {err}"
                    ) from err
                time.sleep(CONNECT_RETRY_SECONDS)

    def leave(self) -> None:
        if self.store is not None:
            dist.destroy_process_group()
            self.store = None

    def gather(self, flat: Any) -> list[Any]:
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(parts, flat)
        return parts

    def answer_step(self, request: str, proposal: int) -> int:
        """The step every rank saves to answer ``request``: the first rank's proposal, which
        it publishes for ``answers`` of every rank."""
        key = f"matrixpool/answer/{request}"
        if self.store.add(key, 1) == 1:
            self.store.set(f"{key}/step", str(proposal))
            number = self.store.add(ANSWERS, 1)
            self.store.set(f"{ANSWERS}/{number}", request)
        return int(self.store.get(f"{key}/step"))

    def answers(self) -> list[tuple[str, int]]:
        """Requests some rank published since the last call, with their steps. A rank proposes
        at most two steps ahead of where it is, after its step's gather, so every rank reads it
        here before making that step, whenever its own annotation shows the request."""
        count = int(self.store.add(ANSWERS, 0))
        found = []
        for number in range(self.answers_read + 1, count + 1):
            request = bytes(self.store.get(f"{ANSWERS}/{number}")).decode()
            found.append((request, int(self.store.get(f"matrixpool/answer/{request}/step"))))
        self.answers_read = count
        return found


# --- one rank ---------------------------------------------------------------------------------


class BrokenGangError(Exception):
    """A collective failed: a rank of the gang is gone."""


class TorchTrainer:
    """One rank's loop: train, save, follow the pod's annotations, recover in place."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.settings = Settings.from_env(env)
        self.me = recovery_torch.Rank.from_env(env)  # the Checkpointer, the restore followed
        ckpt = self.checkpointer = self.me.checkpointer
        self.rank, self.job, self.world_size = ckpt.rank, ckpt.job, ckpt.world_size
        self.steps = int(env.get(trainer.STEPS_VARIABLE) or 0)  # the last step; 0: forever
        self.pause = float(env.get(PAUSE_VARIABLE) or 0)  # seconds slept per step
        self.annotations_file = env.get("MATRIXPOOL_ANNOTATIONS_FILE")
        master = Master.from_env(env, self.rank, self.world_size)
        self.gang = Gang(master, self.rank, self.world_size, self.settings.timeout)
        seen = trainer.read_annotations(self.annotations_file)
        self.request_seen = seen.get(labels.CHECKPOINT_REQUEST, "")
        self.answers: dict[str, int] = {}  # request -> the step to save on every tier
        self.model = model_for(self.settings)
        self.optimizer = optimizer_for(self.model)
        self.step = self.start()

    def run(self) -> None:
        try:
            while not 0 < self.steps <= self.step:
                try:
                    loss = self.train_step()
                    self.save(self.step, loss)
                except BrokenGangError as broken:
                    trainer.report(rank=self.rank, step=self.step, broken=str(broken))
                    self.await_restore()
                    continue
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
        """``dcp.save`` at a step due on some tier, or asked for by a checkpoint request (then
        on every configured tier: the writer's ``tiers``). Every rank decides alike (the same
        spec, the same published answers): DCP's save is a collective."""
        answered = sorted(request for request, at in self.answers.items() if at <= step)
        spec = self.checkpointer.spec
        tiers = spec.configured() if answered else spec.due(step)
        done: dict[str, Any] = {"answered": ",".join(answered)} if answered else {}
        if tiers:
            for request in answered:
                del self.answers[request]
            writer = recovery_torch.StorageWriter(tiers=tiers if answered else None, rank=self.me)
            try:
                state = state_of(self.model, self.optimizer)
                dcp.save(state, checkpoint_id=str(step), storage_writer=writer)
            except RuntimeError as err:  # a collective of the save: a peer is gone
                raise BrokenGangError(str(err)) from err
            except CheckpointException as err:  # a tier failed, on some rank: every rank sees it
                done = {"save_failed": str(err)}
        trainer.report(rank=self.rank, step=step, loss=loss, **done)

    def follow_annotations(self) -> None:
        """Answer a new checkpoint request (one another rank published, or one this rank's
        annotation shows first); reload on a new restore."""
        for request, at in self.gang.answers():
            self.answers[request] = at
            self.request_seen = request
        seen = trainer.read_annotations(self.annotations_file)
        request = seen.get(labels.CHECKPOINT_REQUEST, "")
        if request and request != self.request_seen:
            self.request_seen = request
            # Ranks are at most one step apart (each step gathers): all can make step + 2.
            self.answers[request] = self.gang.answer_step(request, self.step + 2)
        if self.restore_asked():
            self.reload()

    def restore_asked(self) -> bool:
        """Whether the restore annotation changed to a value not loaded yet."""
        asked = self.me.follow()
        return asked is not None and not self.me.loaded

    def await_restore(self) -> None:
        """After a broken collective: wait for the recovery's restore annotation, or exit 1."""
        deadline = clock.SYSTEM.monotonic() + self.settings.timeout
        while clock.SYSTEM.monotonic() < deadline:
            if self.restore_asked():
                self.reload()
                return
            time.sleep(POLL_SECONDS)
        trainer.report(rank=self.rank, step=self.step, error="no recovery came: exiting")
        raise SystemExit(1)

    def reload(self) -> None:
        self.answers = {}
        self.gang.leave()
        self.step = self.start()

    def start(self) -> int:
        """Join the gang of the run the restore annotation names (``Rank.follow`` started its
        incarnation) and load what ``latest()`` names; the step to go on from."""
        asked = self.me.follow()
        recovery = asked.recovery if asked is not None else ""
        self.gang.join(self.checkpointer.incarnation, recovery)
        found = recovery_torch.latest(self.me)
        if found is None:  # step 0: the initial weights, a new optimizer
            self.model.load_state_dict(model_for(self.settings).state_dict())
            self.optimizer = optimizer_for(self.model)
            fresh = {"fresh": True, "recovery": recovery} if asked and asked.fresh else {}
            trainer.report(rank=self.rank, step=0, restored=None, **fresh)
            return 0
        state = state_of(self.model, self.optimizer)  # the model's own tensors, filled in place
        reader = recovery_torch.StorageReader(rank=self.me)
        dcp.load(state, checkpoint_id=found, storage_reader=reader)
        load(self.model, self.optimizer, state)
        step = int(found)
        trainer.report(
            rank=self.rank,
            step=step,
            restored=step,
            source=reader.sources.get(self.rank, reader.metadata_source),
            sources={str(rank): source for rank, source in sorted(reader.sources.items())},
            recovery=recovery,
        )
        return step


def main() -> int:
    with deterministic():
        TorchTrainer(os.environ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
