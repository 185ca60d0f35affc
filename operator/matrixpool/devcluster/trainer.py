"""A simulated trainer rank: the stand-in for a training process in a pod of the local cluster.

Started by ``matrixpool sim`` (one process per Running TrainingJob pod) with the
``MATRIXPOOL_*`` environment the real trainer images get (see
``matrixpool_recovery.client.Checkpointer.from_env``). Its state is a function of
(job, rank, step), so tests can check that restored bytes equal what was saved.

What it does, as a real trainer would:
1. At start it restores what the pod says (annotation ``matrixpool.dev/restore``, passed as
   ``MATRIXPOOL_RESTORE``; see :mod:`matrixpool.checkpoints`), else starts at step 0.
2. It advances one step every ``MATRIXPOOL_SIM_STEP_SECONDS`` and checkpoints as the job's spec
   says, with the real :class:`~matrixpool_recovery.client.Checkpointer`.
3. Between steps it reads its pod's annotations (``MATRIXPOOL_ANNOTATIONS_FILE``, the
   downward-API format ``key="value"``): a new ``matrixpool.dev/checkpoint-request`` id is
   answered by saving the next step to every configured tier at once; a new
   ``matrixpool.dev/restore`` (a recovery rolled the gang back) reloads that step in place.

It reports progress as JSON lines on stdout: ``{"rank", "step", "restored", "source", ...}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matrixpool import checkpoints
from matrixpool.api import labels
from matrixpool_recovery import client, errors

STATE_BYTES = 64 << 10  # bytes of simulated state per rank


def state_of(job: str, rank: int, step: int, size: int = STATE_BYTES) -> bytes:
    """The simulated state of ``rank`` after ``step``: deterministic, different every step."""
    seed = hashlib.blake2b(f"{job}/{rank}/{step}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def read_annotations(path: str | None) -> dict[str, str]:
    """A downward-API annotations file (``key="value"`` lines); {} when absent."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            try:
                found[key] = str(json.loads(value))
            except ValueError:
                continue
    return found


class Trainer:
    """One rank's loop."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.checkpointer = client.Checkpointer.from_env(env)
        self.rank, self.job = self.checkpointer.rank, self.checkpointer.job
        self.size = int(env.get("MATRIXPOOL_SIM_STATE_BYTES") or STATE_BYTES)
        self.pause = float(env.get("MATRIXPOOL_SIM_STEP_SECONDS") or 0.5)
        self.annotations_file = env.get("MATRIXPOOL_ANNOTATIONS_FILE")
        seen = read_annotations(self.annotations_file)
        self.restore_seen = env.get("MATRIXPOOL_RESTORE") or seen.get(labels.RESTORE, "")
        self.request_seen = seen.get(labels.CHECKPOINT_REQUEST, "")
        self.step = self.restore(self.restore_seen)

    def run(self) -> None:
        try:
            while True:
                self.step += 1
                self.checkpointer.save(self.step, {"state": self.state(self.step)})
                report(rank=self.rank, step=self.step)
                time.sleep(self.pause)
                self.follow_annotations()
        finally:
            self.checkpointer.close()

    def state(self, step: int) -> bytes:
        return state_of(self.job, self.rank, step, self.size)

    def follow_annotations(self) -> None:
        seen = read_annotations(self.annotations_file)
        request = seen.get(labels.CHECKPOINT_REQUEST, "")
        if request and request != self.request_seen:
            self.request_seen = request
            self.step += 1
            tiers = self.checkpointer.spec.configured()
            state = {"state": self.state(self.step)}
            handle = self.checkpointer.save(self.step, state, tiers=tiers)
            handle.done.wait()
            report(rank=self.rank, step=self.step, answered=request, tiers=list(tiers))
        restore = seen.get(labels.RESTORE, "")
        if restore and restore != self.restore_seen:
            self.restore_seen = restore
            self.step = self.restore(restore)

    def restore(self, where: str | None) -> int:
        """The step to continue from: the restored one, or 0 for a fresh start."""
        try:
            asked = checkpoints.parse_restore(where)
        except ValueError as error:
            report(rank=self.rank, step=0, restored=None, error=str(error))
            return 0
        if asked is None:
            report(rank=self.rank, step=0, restored=None)
            return 0
        # A reader of its own: the saves in flight (a peer copy to a dead node, say) must not
        # hold the reload up; the daemons the operator named hold the copies it chose.
        peers = self.env.get("MATRIXPOOL_CKPT_PEERS", "").split(",")
        wider = ",".join(dict.fromkeys(p for p in [*peers, *asked.sources] if p))
        reader = client.Checkpointer.from_env({**self.env, "MATRIXPOOL_CKPT_PEERS": wider})
        try:
            restored = reader.restore(asked.step)
        except errors.NoCheckpointError as error:
            report(rank=self.rank, step=0, restored=None, error=str(error), asked=where)
            return 0
        finally:
            reader.close()
        expected = state_of(self.job, self.rank, restored.step, self.size)
        report(
            rank=self.rank,
            step=restored.step,
            restored=restored.step,
            source=restored.source,
            intact=bytes(restored.state["state"]) == expected,
            recovery=asked.recovery,
            skipped=list(restored.skipped),
            asked=where,
        )
        return restored.step


def report(**fields: Any) -> None:
    print(json.dumps({"t": round(time.time(), 3), **fields}), flush=True)


def main() -> int:
    Trainer(os.environ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
