"""A container's ``resources.limits.cpu`` is a CFS quota, as a kubelet sets it: a process the
process kubelet starts under a limit of a fifth of a core gets about that much CPU time."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from matrixpool.devcluster import cgroups


@pytest.mark.parametrize(
    ("quantity", "cores"), [("250m", 0.25), ("0.5", 0.5), (2, 2.0), ("", None), (None, None)]
)
def test_cpu_quantities_in_cores(quantity: str | int | None, cores: float | None) -> None:
    assert cgroups.cpu_cores(quantity) == cores


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_cpu_limit_holds_a_busy_process_to_its_quota() -> None:
    parent, v1 = cgroups.root(), cgroups.cpu_root()
    try:
        group = cgroups.make(parent, "busy")
        cpu = cgroups.limit_cpu(group, v1, "busy", 0.2)
        assert cpu is not None or (group is not None and (group / "cpu.max").exists()), (
            "this machine enforces no CPU limit (no cpu controller in either hierarchy)"
        )
        argv = cgroups.enter(group, ["sh", "-c", "while :; do :; done"], cpu)
        with subprocess.Popen(argv) as busy:
            try:
                time.sleep(2.0)
                used = _cpu_seconds(busy.pid)
            finally:
                busy.kill()
                busy.wait()
        assert used < 2.0 * 0.2 * 1.5, used  # at most the quota (some slack for the period)
        assert used > 2.0 * 0.2 * 0.4, used  # and it did run
    finally:
        cgroups.remove(parent)
        cgroups.remove(v1)
