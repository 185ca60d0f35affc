"""A trainer process of the multi-process checkpoint tests: one rank saving or restoring.

Run by tests/checkpoint/conftest.py as ``python -m tests.checkpoint.trainer save|restore ...``
with its job's token in ``MATRIXPOOL_CKPT_TOKEN``; prints one JSON object per line on stdout.
The state of (rank, step) is deterministic (``state_for``), so the test process can compare
restored bytes with what was saved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import numpy as np

from matrixpool_recovery import Checkpointer, CheckpointError, CheckpointSpec, TierWriteError


def state_for(rank: int, step: int) -> dict[str, Any]:
    """What rank `rank` holds after step `step`: a few arrays and some bytes."""
    rng = np.random.default_rng(rank * 100_003 + step)
    return {
        "weights": rng.standard_normal((64, 512)).astype(np.float32),
        "optimizer": rng.integers(0, 255, 96_001, dtype=np.uint8),
        "meta": f"rank {rank} step {step}".encode(),
    }


def digest(state: dict[str, Any]) -> str:
    """SHA-256 over every value's bytes, in key order (independent of the shard checksum)."""
    hasher = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        hasher.update(name.encode())
        hasher.update(value if isinstance(value, bytes) else np.ascontiguousarray(value).data)
    return hasher.hexdigest()


def same(restored: Any, saved: Any) -> bool:
    if isinstance(saved, bytes):
        return bool(restored == saved)
    return restored.dtype == saved.dtype and np.array_equal(restored, saved)


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def save(ckpt: Checkpointer, steps: list[int]) -> None:
    for step in steps:
        state = state_for(ckpt.rank, step)
        handle = ckpt.save(step, state)
        try:
            outcomes = handle.wait()
            say(step=step, outcomes=outcomes)
        except TierWriteError as err:
            say(step=step, outcomes=handle.outcomes, error=str(err))


def restore(ckpt: Checkpointer, step: int | None) -> None:
    restored = ckpt.restore(step)
    expected = state_for(ckpt.rank, restored.step)
    equal = digest(restored.state) == digest(expected) and all(
        same(restored.state[name], value) for name, value in expected.items()
    )
    say(
        step=restored.step,
        source=restored.source,
        skipped=list(restored.skipped),
        sha256=digest(restored.state),
        equal=equal,
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["save", "restore"])
    parser.add_argument("--job", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--daemon", required=True)
    parser.add_argument("--spec", default="{}", help="the TrainingJob's spec.checkpoint as JSON")
    parser.add_argument("--steps", default="", help="steps to save, comma-separated")
    parser.add_argument("--step", type=int, help="step to restore (default: newest committed)")
    parser.add_argument("--peers", default="", help="daemons of the job's other nodes")
    args = parser.parse_args()
    spec = CheckpointSpec.from_json(args.spec)
    try:
        peers = [p for p in args.peers.split(",") if p]
        with Checkpointer(
            args.job,
            args.rank,
            args.world,
            args.daemon,
            os.environ["MATRIXPOOL_CKPT_TOKEN"],
            spec=spec,
            peers=peers,
        ) as ckpt:
            if args.action == "save":
                save(ckpt, [int(s) for s in args.steps.split(",") if s])
            else:
                restore(ckpt, args.step)
    except CheckpointError as err:
        say(error=type(err).__name__, message=str(err))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
