"""A simulated trainer rank: the stand-in for a training process in a pod of the local cluster.

Started by ``matrixpool sim`` (one process per Running TrainingJob pod) with the
``MATRIXPOOL_*`` environment the real trainer images get (see
``matrixpool_recovery.client.Checkpointer.from_env``). It restores where the pod says
(annotation ``matrixpool.dev/restore``, passed as ``MATRIXPOOL_RESTORE``: ``latest`` or a step),
then advances one step every ``MATRIXPOOL_SIM_STEP_SECONDS`` and checkpoints as the job's spec
says, with the real :class:`~matrixpool_recovery.client.Checkpointer`. Its state is a function of
(job, rank, step), so tests can check that restored bytes equal what was saved.

It reports progress as JSON lines on stdout: ``{"rank", "step", "restored", "source"}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

from matrixpool_recovery import client, errors

STATE_BYTES = 64 << 10  # bytes of simulated state per rank


def state_of(job: str, rank: int, step: int, size: int = STATE_BYTES) -> bytes:
    """The simulated state of ``rank`` after ``step``: deterministic, different every step."""
    seed = hashlib.blake2b(f"{job}/{rank}/{step}".encode(), digest_size=32).digest()
    return (seed * (size // len(seed) + 1))[:size]


def main() -> int:
    env = os.environ
    checkpointer = client.Checkpointer.from_env()
    rank, job = checkpointer.rank, checkpointer.job
    size = int(env.get("MATRIXPOOL_SIM_STATE_BYTES") or STATE_BYTES)
    pause = float(env.get("MATRIXPOOL_SIM_STEP_SECONDS") or 0.5)
    step = restore(checkpointer, env.get("MATRIXPOOL_RESTORE"), size)
    try:
        while True:
            step += 1
            checkpointer.save(step, {"state": state_of(job, rank, step, size)})
            report(rank=rank, step=step)
            time.sleep(pause)
    finally:
        checkpointer.close()


def restore(checkpointer: client.Checkpointer, where: str | None, size: int) -> int:
    """The step to continue from: the restored one, or 0 for a fresh start."""
    if not where:
        report(rank=checkpointer.rank, step=0, restored=None)
        return 0
    try:
        restored = checkpointer.restore(None if where == "latest" else int(where))
    except errors.NoCheckpointError as error:
        report(rank=checkpointer.rank, step=0, restored=None, error=str(error))
        return 0
    expected = state_of(checkpointer.job, checkpointer.rank, restored.step, size)
    intact = bytes(restored.state["state"]) == expected
    report(
        rank=checkpointer.rank,
        step=restored.step,
        restored=restored.step,
        source=restored.source,
        intact=intact,
    )
    return restored.step


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    sys.exit(main())
