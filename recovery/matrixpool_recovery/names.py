"""Validation of the names that become paths: job names, ranks and steps.

The daemon and the client call these before a name reaches the file system, so that no request
can read or write outside the daemon's directories (``..``, ``/``, absolute paths, NUL).
"""

from __future__ import annotations

import re
from pathlib import Path

from matrixpool_recovery import errors

# Letters, digits, '.', '_' and '-', starting and ending with a letter or digit; "ns.job" fits.
_JOB = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
MAX_RANK = 1 << 20  # more ranks than any supernode has cards
MAX_STEP = 10**15  # steps are written with 16 digits


def job(name: str) -> str:
    """The job name unchanged, or InvalidNameError when it could escape a directory."""
    if not _JOB.fullmatch(name) or ".." in name:
        raise errors.InvalidNameError(f"invalid job name {name!r}: letters, digits, '.', '_', '-'")
    return name


def number(text: str | int, what: str, limit: int) -> int:
    """A rank or step given as text or int, checked to be a plain non-negative integer."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 16:
        value = int(text)
    else:
        raise errors.InvalidNameError(f"invalid {what} {text!r}: a non-negative integer")
    if not 0 <= value <= limit:
        raise errors.InvalidNameError(f"invalid {what} {value}: out of range 0..{limit}")
    return value


def rank(text: str | int) -> int:
    return number(text, "rank", MAX_RANK)


def step(text: str | int) -> int:
    return number(text, "step", MAX_STEP)


def step_dir(step_number: int) -> str:
    """Directory name of a step; zero-padded so names sort by step."""
    return f"step-{step_number:016d}"


def inside(root: Path, *parts: str) -> Path:
    """root/parts, refusing a result that resolves outside root (defence in depth)."""
    path = root.joinpath(*parts)
    if not path.resolve().is_relative_to(root.resolve()):
        raise errors.InvalidNameError(f"path {path} escapes {root}")
    return path
