"""A small tmpfs mounted for one test: a memory directory or a disk that fills up for real.

Used by the memory and files unit tests and by the checkpoint tests. Mounting needs root (CI
runs as root); elsewhere the test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests import ci


@contextlib.contextmanager
def mounted(where: Path, size: str) -> Iterator[Path]:
    """`where` as a tmpfs of `size` (e.g. "8m") until the block ends."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        ci.cannot_run(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(where: Path) -> Path:
    """A file that takes every free byte of the file system at `where`."""
    filler = where / "filler"
    with open(filler, "wb") as file, contextlib.suppress(OSError):
        for _ in range(1 << 16):
            file.write(bytes(1 << 16))
            file.flush()
    return filler
