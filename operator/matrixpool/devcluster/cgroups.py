"""Container cgroups for ``matrixpool sim``'s process kubelet: every process a container
starts, in any session, is found and killed with it, as a runtime kills a container's whole
PID namespace. cgroup v2 (``cgroup.kill``, Linux 5.14+), under the machine's cgroup2 mount
(``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a hybrid host); where there is none or it
cannot be written, :func:`root` is None and a container is swept by its process group only.

A container's ``resources.limits.cpu`` is a CFS quota, as a kubelet sets it: ``cpu.max`` in the
container's cgroup where the v2 hierarchy has the cpu controller, else ``cpu.cfs_quota_us`` in
a cgroup of the v1 cpu hierarchy (``/sys/fs/cgroup/cpu``, a hybrid host's) under
:func:`cpu_root`; where neither can be written the limit is not enforced (said once)."""

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


def enter(group: Path | None, argv: Sequence[str], *more: Path | None) -> list[str]:
    """``argv``, run from inside ``group`` and the ``more`` groups (another hierarchy's: the
    CPU limit's) — the shell moves itself in, then execs: the pid stays the container's."""
    groups = [g for g in (group, *more) if g is not None]
    if not groups:
        return list(argv)
    moves = " && ".join(f"echo $$ > {shlex.quote(str(g / 'cgroup.procs'))}" for g in groups)
    return ["sh", "-c", f'{moves} && exec "$@"', "sh", *argv]


CFS_PERIOD_US = 100_000  # a kubelet's CFS period


def cpu_root(v1: Path = Path("/sys/fs/cgroup/cpu")) -> Path | None:
    """A cgroup of this process's own in the v1 cpu hierarchy, for CPU limits; None where the
    host has none (then the v2 cgroups of :func:`root` carry ``cpu.max``, if anything)."""
    if not (v1 / "cpu.cfs_quota_us").exists():
        return None
    folder = v1 / f"matrixpool-sim-{os.getpid()}"
    try:
        folder.mkdir(exist_ok=True)
    except OSError:
        return None
    return folder


def limit_cpu(group: Path | None, v1_parent: Path | None, name: str, cores: float) -> Path | None:
    """Limit a container to ``cores`` CPUs: ``cpu.max`` in its v2 ``group`` when that takes it
    (then None: nothing more to enter), else a v1 cpu cgroup ``name`` under ``v1_parent`` with
    that quota, returned for :func:`enter`; None as well when neither can be written."""
    quota = max(1000, round(cores * CFS_PERIOD_US))
    if group is not None:
        with contextlib.suppress(OSError):
            (group / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
            return None
    if v1_parent is None:
        return None
    folder = v1_parent / name.replace("/", "_")
    try:
        folder.mkdir(exist_ok=True)
        (folder / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
        (folder / "cpu.cfs_quota_us").write_text(str(quota))
    except OSError:
        return None
    return folder


def cpu_cores(quantity: str | int | float | None) -> float | None:
    """A CPU quantity as Kubernetes writes it ("250m", "0.5", 2) in cores; None for none."""
    if quantity is None or quantity == "":
        return None
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


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
