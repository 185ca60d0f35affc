"""A simulated trainer rank: the stand-in for a training process in a pod of the local cluster.

The command of a TrainingJob pod's container (``python -m matrixpool.devcluster.trainer``, image
``matrixpool``), run by ``matrixpool sim``'s process kubelet like any container: everything it
knows comes from the pod the operator wrote (docs/concepts.md, "What your training container
gets"; ``matrixpool_recovery.client.Checkpointer.from_env``). Its state is a function of
(job, rank, step), so tests can check that restored bytes equal what was saved. The pod's env
may also set ``MATRIXPOOL_SIM_STEP_SECONDS`` (compute per step, default 0.5),
``MATRIXPOOL_SIM_STATE_BYTES`` (state per rank, default 64 KiB) and ``MATRIXPOOL_SIM_STEPS``.

What it does, as a real trainer would:
1. At start it restores what the pod says (annotation ``matrixpool.dev/restore`` in its
   annotations file; see :mod:`matrixpool.k8s.daemonclient`), else starts at step 0; a
   restore that says ``fresh`` (the job had no checkpoint yet) starts at step 0 as the new
   incarnation, reading nothing. After a regroup to more ranks (the restore names the
   ``world`` that wrote the step), a rank that world lacked reads shard ``rank % world``.
2. It advances one step every ``MATRIXPOOL_SIM_STEP_SECONDS`` and checkpoints as the job's spec
   says, with the real :class:`~matrixpool_recovery.client.Checkpointer`.
3. After each step it waits until every rank of the gang finished it (:class:`Barrier`, the
   stand-in for collectives: a file per job and world size in ``MATRIXPOOL_SIM_BARRIERS``,
   default the machine's temporary folder, which every simulated node shares), so ranks stay
   in step and a dead rank stops the others.
4. Between steps it reads its pod's annotations (``MATRIXPOOL_ANNOTATIONS_FILE``, the
   downward-API format ``key="value"``): a new ``matrixpool.dev/checkpoint-request`` id is
   answered by saving an agreed near step to every configured tier; a new
   ``matrixpool.dev/restore`` (a recovery rolled the gang back) reloads that step in place.
5. With ``MATRIXPOOL_SIM_STEPS`` (from the pod's env) it exits 0 once the whole gang finished
   that step: training is done, and the sim reports the pod Succeeded. Without it, it steps
   until it is killed.

It reports progress as JSON lines on stdout: ``{"rank", "step", "restored", "source", ...}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matrixpool import clock
from matrixpool.api import labels
from matrixpool_recovery import client, errors
from matrixpool_recovery import restore as restore_codec

STATE_BYTES = 64 << 10  # bytes of simulated state per rank
STEPS_VARIABLE = "MATRIXPOOL_SIM_STEPS"  # pod env: exit 0 after this step (absent: never)


def container(step_seconds: float = 0.5, name: str = "trainer", **env: str) -> dict[str, Any]:
    """This trainer as a TrainingJob template's container: image ``matrixpool`` (which
    ``matrixpool sim`` runs as a process), ``step_seconds`` of compute per step, ``env``."""
    return {
        "name": name,
        "image": "matrixpool:sim",
        "command": ["python", "-m", "matrixpool.devcluster.trainer"],
        "env": [
            {"name": "MATRIXPOOL_SIM_STEP_SECONDS", "value": str(step_seconds)},
            *({"name": k, "value": v} for k, v in env.items()),
        ],
    }


def state_of(job: str, rank: int, step: int, size: int = STATE_BYTES) -> bytes:
    """The simulated state of ``rank`` after ``step``: deterministic, different every step."""
    seed = hashlib.blake2b(f"{job}/{rank}/{step}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def barrier_path(env: Mapping[str, str], job: str, world_size: int) -> Path:
    """Where the gang's ranks meet: one file per job (UID) and world size."""
    folder = env.get("MATRIXPOOL_SIM_BARRIERS") or tempfile.gettempdir()
    return Path(folder) / "matrixpool-barriers" / f"{job}.w{world_size}"


read_annotations = restore_codec.read_annotations  # the downward-API annotations file


class Barrier:
    """The gang's step barrier, as collectives make one: a file of one int64 per rank (the
    newest step the rank finished); a rank goes on to step s+1 only once every rank finished
    s. A rank that died leaves its slot behind, so the others wait for its replacement, as
    real ranks hang in their next all-reduce. Also where ranks agree on the step that answers
    a checkpoint request (the first rank to see it writes it, the others read it)."""

    def __init__(self, path: Path, world_size: int) -> None:
        self.path, self.world_size = path, world_size
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 8 * world_size:
                os.pwrite(fd, struct.pack(f"<{world_size}q", *([-1] * world_size)), 0)
        finally:
            os.close(fd)

    def arrive(self, rank: int, step: int) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            os.pwrite(fd, struct.pack("<q", step), 8 * rank)
        finally:
            os.close(fd)

    def slowest(self) -> int:
        data = self.path.read_bytes()[: 8 * self.world_size]
        return min(int(v) for v in struct.unpack(f"<{self.world_size}q", data))

    def answer_step(self, request: str, proposal: int) -> int:
        """The step every rank saves to answer ``request``: the first proposal written."""
        agreed = self.path.with_name(f"{self.path.name}.answer.{request}")
        try:
            fd = os.open(agreed, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            for _ in range(100):  # the winner may still be writing it
                if text := agreed.read_text().strip():
                    return int(text)
                time.sleep(0.01)
            return proposal
        with os.fdopen(fd, "w") as out:
            out.write(str(proposal))
        return proposal


class Trainer:
    """One rank's loop: compute, save, wait for the gang, follow the pod's annotations."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.checkpointer = client.Checkpointer.from_env(env)
        self.rank, self.job = self.checkpointer.rank, self.checkpointer.job
        self.size = int(env.get("MATRIXPOOL_SIM_STATE_BYTES") or STATE_BYTES)
        self.pause = float(env.get("MATRIXPOOL_SIM_STEP_SECONDS") or 0.5)
        self.steps = int(env.get(STEPS_VARIABLE) or 0)  # the last step; 0: train forever
        self.annotations_file = env.get("MATRIXPOOL_ANNOTATIONS_FILE")
        world = self.checkpointer.world_size
        self.barrier = Barrier(barrier_path(env, self.job, world), world) if world > 1 else None
        seen = read_annotations(self.annotations_file)
        self.restore_seen = seen.get(labels.RESTORE, "")
        self.request_seen = seen.get(labels.CHECKPOINT_REQUEST, "")
        self.answer_at: tuple[str, int] | None = None  # (request, step) to save on every tier
        self.step = self.restore(self.restore_seen)

    def run(self) -> None:
        try:
            while not self.finished():
                time.sleep(self.pause)  # the step's compute
                self.step += 1
                self.save(self.step)
                if self.barrier is not None:
                    self.barrier.arrive(self.rank, self.step)
                self.wait_for_gang()
                self.follow_annotations()
            report(rank=self.rank, step=self.step, finished=True)
        finally:
            self.checkpointer.close()

    def finished(self) -> bool:
        """The whole gang trained the last step (``MATRIXPOOL_SIM_STEPS``)."""
        return 0 < self.steps <= self.step

    def state(self, step: int) -> bytes:
        return state_of(self.job, self.rank, step, self.size)

    def save(self, step: int) -> None:
        if self.answer_at is not None and step >= self.answer_at[1]:
            request, _ = self.answer_at
            self.answer_at = None
            tiers = self.checkpointer.spec.configured()
            handle = self.checkpointer.save(step, {"state": self.state(step)}, tiers=tiers)
            handle.done.wait()
            report(rank=self.rank, step=step, answered=request, tiers=list(tiers))
            return
        self.checkpointer.save(step, {"state": self.state(step)})
        report(rank=self.rank, step=step)

    def wait_for_gang(self) -> None:
        """Until every rank finished this step; a new restore ends the wait (and rolls back)."""
        while self.barrier is not None and self.barrier.slowest() < self.step:
            if self.follow_annotations():
                return
            time.sleep(0.05)

    def follow_annotations(self) -> bool:
        """React to a new checkpoint request or restore; True when the rank rolled back."""
        seen = read_annotations(self.annotations_file)
        request = seen.get(labels.CHECKPOINT_REQUEST, "")
        if request and request != self.request_seen:
            self.request_seen = request
            proposal = self.step + 2  # ranks are at most one step apart: both can make it
            agreed = self.barrier.answer_step(request, proposal) if self.barrier else proposal
            self.answer_at = (request, agreed)
        restore = seen.get(labels.RESTORE, "")
        if restore and restore != self.restore_seen:
            self.restore_seen = restore
            self.step = self.restore(restore)
            return True
        return False

    def restore(self, where: str | None) -> int:
        """The step to continue from: the restored one, or 0 for a fresh start."""
        try:
            asked = restore_codec.parse_restore(where)
        except ValueError as error:
            report(rank=self.rank, step=0, restored=None, error=str(error))
            return 0
        if asked is None:
            report(rank=self.rank, step=0, restored=None)
            return 0
        if asked.incarnation is not None:  # from here on this rank saves as the new run
            self.checkpointer.start_incarnation(asked.incarnation)
        if asked.fresh:  # no checkpoint yet: start over, read nothing
            report(rank=self.rank, step=0, restored=None, fresh=True, recovery=asked.recovery)
            if self.barrier is not None:
                self.barrier.arrive(self.rank, 0)
            return 0
        # A reader of its own: the saves in flight (a peer copy to a dead node, say) must not
        # hold the reload up. First only the daemons the operator named (it chose the copies:
        # one inventory per rank, not one per rank and peer), then every peer of the gang.
        peers = self.env.get("MATRIXPOOL_CKPT_PEERS", "").split(",")
        narrow = ",".join(asked.sources)
        wide = ",".join(dict.fromkeys(p for p in [*peers, *asked.sources] if p))
        attempts = [narrow, wide] if asked.step is not None else [wide]
        shard = restore_codec.shard_for(self.rank, asked.world)  # after a regroup to more ranks
        for index, listed in enumerate(attempts):
            reader = client.Checkpointer.from_env({**self.env, "MATRIXPOOL_CKPT_PEERS": listed})
            try:
                restored = reader.restore(asked.step, incarnation=asked.of, rank=shard)
                break
            except errors.NoCheckpointError as error:
                if index == len(attempts) - 1:
                    report(rank=self.rank, step=0, restored=None, error=str(error), asked=where)
                    return 0
            finally:
                reader.close()
        self.checkpointer.base = restored.step
        expected = state_of(self.job, shard, restored.step, self.size)
        report(
            rank=self.rank,
            step=restored.step,
            restored=restored.step,
            shard=shard,
            world=self.checkpointer.world_size,
            source=restored.source,
            intact=bytes(restored.state["state"]) == expected,
            recovery=asked.recovery,
            skipped=list(restored.skipped),
            asked=where,
        )
        if self.barrier is not None:
            self.barrier.arrive(self.rank, restored.step)
        return restored.step


def report(**fields: Any) -> None:
    print(json.dumps({"t": round(clock.SYSTEM.now().timestamp(), 3), **fields}), flush=True)


def main() -> int:
    Trainer(os.environ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
