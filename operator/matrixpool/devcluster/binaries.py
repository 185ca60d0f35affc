"""Finds or builds the local cluster's binaries (etcd, kube-*, kubelet, kube-proxy, kwok, helm,
CoreDNS, pause).

``tools/k8s/build.sh`` builds each from the Go modules pinned in ``tools/k8s/versions.env``, once
per recipe (``~/.cache/matrixpool/bin/by-recipe/``), links the current ones into
``~/.cache/matrixpool/bin/<set-hash>/`` and prints that folder last; a complete folder is reused
at once. ``MATRIXPOOL_BIN_DIR`` points at a prebuilt folder instead.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

REQUIRED = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "helm",
    "coredns",
)


class BuildError(RuntimeError):
    """The binaries could not be built or found."""


def repo_root() -> Path:
    """The source checkout this package runs from (operator/matrixpool/devcluster/ → root)."""
    return Path(__file__).resolve().parents[3]


def ensure(progress: Callable[[str], None] = print) -> Path:
    """The folder holding every binary, building them first when needed."""
    override = os.environ.get("MATRIXPOOL_BIN_DIR")
    if override:
        folder = Path(override)
        missing = [b for b in REQUIRED if not (folder / b).exists()]
        if missing:
            raise BuildError(f"MATRIXPOOL_BIN_DIR={folder} lacks {', '.join(missing)}")
        return folder
    script = repo_root() / "tools" / "k8s" / "build.sh"
    if not script.exists():
        raise BuildError(f"{script} not found: set MATRIXPOOL_BIN_DIR to prebuilt binaries")
    return build(script, progress)


def build(script: Path, progress: Callable[[str], None]) -> Path:
    """Run a build script that reports progress on stderr and prints its result's path as
    its last line; that path."""
    with subprocess.Popen(
        [str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stderr is not None
        assert process.stdout is not None
        for line in process.stderr:
            progress(line.rstrip())
        output = process.stdout.read().strip().splitlines()
    if process.returncode != 0 or not output:
        raise BuildError(f"{script} failed (exit {process.returncode}); see the lines above")
    return Path(output[-1])
