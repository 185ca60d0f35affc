"""What the example scripts print, read back by the tests that compare a run through faults
with a fault-free one (examples/pytorch-*.yaml): one JSON line per step and rank, a digest of
the parameters at the end. torchrun's workers share one stdout, so lines may run into each
other: read by pattern, never line by line."""

from __future__ import annotations

import re

DIGEST = re.compile(r'"digest": "([0-9a-f]{64})"')
LOSS = re.compile(r'\{"rank": (\d+), "step": (\d+), "loss": ([-+.0-9eE]+|NaN)\}')

Losses = dict[tuple[int, int], list[str]]  # (rank, step) -> every loss printed, in order


def losses(text: str) -> Losses:
    """Every loss a log printed per (rank, step), in order: a step run again after a restore
    has two."""
    found: Losses = {}
    for rank, step, loss in LOSS.findall(text):
        found.setdefault((int(rank), int(step)), []).append(loss)
    return found


def merged(*runs: Losses) -> Losses:
    """The losses of several logs (the pods a recovery replaced, the ones that ran last)."""
    out: Losses = {}
    for run in runs:
        for key, values in run.items():
            out.setdefault(key, []).extend(values)
    return out


def first_difference(run: Losses, reference: Losses) -> str:
    """The first (step, rank) whose loss differs from the reference's, said for the message of
    a digest that differs: a restore that loaded the wrong state differs at its first step, a
    step that is not deterministic anywhere."""
    for key in sorted(run, key=lambda k: (k[1], k[0])):
        expected = reference.get(key, ["?"])[0]
        if any(loss != expected for loss in run[key]):
            return f"rank {key[0]} step {key[1]}: {run[key]} (fault-free: {expected})"
    steps = sorted({step for _, step in run})
    span = f"steps {steps[0]}..{steps[-1]}" if steps else "no step"
    return f"every loss printed ({span}) equals the fault-free run's"
