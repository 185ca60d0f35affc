"""Container cgroups for ``matrixpool sim``'s process kubelet: every process a container
starts, in any session, is found and killed with it, as a runtime kills a container's whole
PID namespace. cgroup v2 (``cgroup.kill``, Linux 5.14+), under the machine's cgroup2 mount
(``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid host); where there is none or it
cannot be written, :func:`root` is None and a container is swept by its process group only."""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from collections.abc import Sequence
from pathlib import Path


def root(mounts: Path = Path("/proc/self/mounts")) -> Path | None:
    """A cgroup of this process's own for the containers it runs, or None."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            folder = Path(fields[1]) / f"matrixpool-sim-{os.getpid()}"
            try:
                folder.mkdir(exist_ok=True)
            except OSError:
                return None
            if (folder / "cgroup.kill").exists():
                return folder
            with contextlib.suppress(OSError):
                folder.rmdir()
    return None


def make(parent: Path | None, name: str) -> Path | None:
    """A container's cgroup under ``parent``; None when there is no parent or it fails."""
    if parent is None:
        return None
    folder = parent / name.replace("/", "_")
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        return None
    return folder


def enter(group: Path | None, argv: Sequence[str]) -> list[str]:
    """``argv``, run from inside ``group`` (the shell moves itself in, then execs: the pid
    stays the container's)."""
    if group is None:
        return list(argv)
    procs = shlex.quote(str(group / "cgroup.procs"))
    return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]


def kill(group: Path, wait: float = 1.0) -> None:
    """SIGKILL to every process in ``group``; the folder goes once they are gone (waited
    for up to ``wait`` seconds; a folder left is removed with its parent's)."""
    with contextlib.suppress(OSError):
        (group / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + wait
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a process still dying
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)


def remove(parent: Path | None) -> None:
    """The sim's own cgroup and what is left under it (every process killed first)."""
    if parent is None or not parent.exists():
        return
    for child in parent.iterdir():
        if child.is_dir():
            kill(child)
    with contextlib.suppress(OSError):
        parent.rmdir()
