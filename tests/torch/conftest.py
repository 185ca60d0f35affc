"""Fixtures of the PyTorch tests: checkpoint daemons on loopback (``Cluster`` of
tests/checkpoint), ranks of the real torch trainer
(``python -m matrixpool.devcluster.torch_trainer``, ``Job``) and of the DCP test trainer
(``python -m tests.torch.dcp_worker``, ``Gang``), both joined through torchrun's env
(``MASTER_ADDR`` 127.0.0.1, a free ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), as processes,
each given the pod contract's env by hand, as the operator's pod would (no Kubernetes).

Needs torch: run with the venv ``tools/torch-venv.sh`` makes,
``.venv-torch/bin/pytest tests/torch -q``; without torch every test here is skipped, except
under CI=true, where a missing torch fails the run (``require``).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from matrixpool.api import labels
from tests import ci
from tests.checkpoint.conftest import ROOT, Cluster, job_token
from tests.checkpoint.conftest import cluster as cluster  # the fixture, re-exported


def require(module: str) -> Any:
    """Import ``module`` for a test module; skip that module without it, but fail under CI
    (where `make torch` made the venv that has it: a missing torch is a broken setup)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        ci.cannot_run(
            f"{module} cannot be imported: {error} (run tools/torch-venv.sh)", module=True
        )


WIDTH = 1024  # the MLP's layers: 2 x 1024 x 1024, 8 MB of parameters, 25 MB shards with Adam
DEADLINE = 60.0  # seconds a rank may take to reach what a test waits for
NODES = ("node-a", "node-b")  # one daemon each, each the other's tier-1 peer


def annotate(path: Path, values: dict[str, str]) -> None:
    """Write a downward-API annotations file (``key="value"``), replaced at once as the
    kubelet does."""
    text = "".join(f"{key}={json.dumps(value)}\n" for key, value in values.items())
    temporary = path.with_name(path.name + ".new")
    temporary.write_text(text)
    temporary.replace(path)


def pod_env(
    cluster: Cluster,
    job: str,
    rank: int,
    world: int,
    node: str,
    spec: dict[str, Any],
    incarnation: int,
    annotations: Path,
) -> dict[str, str]:
    """This process's env without MATRIXPOOL_*, plus what the operator's pod of ``rank``
    carries (docs/concepts.md, "What your training container gets"); the job's token file and
    an empty annotations file made if missing."""
    token = cluster.root / f"{job}.token"
    if not token.exists():
        token.touch(mode=0o600)
        token.write_text(job_token(job))
    if not annotations.exists():
        annotate(annotations, {})
    env = {k: v for k, v in os.environ.items() if not k.startswith("MATRIXPOOL_")}
    return env | {
        "MATRIXPOOL_JOB": job,
        "MATRIXPOOL_RANK": str(rank),
        "MATRIXPOOL_WORLD_SIZE": str(world),
        "MATRIXPOOL_INCARNATION": str(incarnation),
        "MATRIXPOOL_CHECKPOINT": json.dumps(spec),
        "MATRIXPOOL_CKPT_DAEMON": cluster.address(node),
        "MATRIXPOOL_CKPT_TOKEN_FILE": str(token),
        "MATRIXPOOL_ANNOTATIONS_FILE": str(annotations),
        "OMP_NUM_THREADS": "1",
    }


def wait_until(check: Callable[[], Any], what: str, deadline: float = DEADLINE) -> Any:
    """Poll ``check`` until it returns something true; fail with ``what`` at the deadline."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if found := check():
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {deadline}s: {what}")


@dataclass
class Rank:
    """One rank process: its JSON lines go to a file the test reads while it runs."""

    rank: int
    process: subprocess.Popen[bytes]
    out: Path  # stdout: the trainer's JSON lines
    err: Path  # stderr

    def lines(self) -> list[dict[str, Any]]:
        text = self.out.read_text() if self.out.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def seen(self, **fields: Any) -> dict[str, Any] | None:
        """The first line holding every one of ``fields`` (value None: the key only)."""
        for line in self.lines():
            if all(k in line and (v is None or line[k] == v) for k, v in fields.items()):
                return line
        return None

    def finish(self, timeout: float = DEADLINE) -> dict[str, Any]:
        """Wait for a clean exit; its last line (``finished`` and ``digest``)."""
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = -9
        assert code == 0, f"rank {self.rank} exited {code}:\n{self.err.read_text()[-4000:]}"
        return self.lines()[-1]

    def kill(self) -> None:
        """kill -9: the rank's pod is gone without a word."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@dataclass
class Job:
    """A TrainingJob of ``world`` torch ranks, rank r on node NODES[r % 2], launched by hand."""

    cluster: Cluster
    name: str
    world: int
    steps: int  # MATRIXPOOL_SIM_STEPS: the step the ranks finish at
    spec: dict[str, Any]  # spec.checkpoint
    port: int  # MASTER_PORT: rank 0's store, the same for every incarnation (as the pod's)
    ranks: list[Rank] = field(default_factory=list)  # every process launched, in order

    def node(self, rank: int) -> str:
        return NODES[rank % len(NODES)]

    def annotations(self, rank: int) -> Path:
        return self.cluster.root / f"{self.name}-{rank}.annotations"

    def launch(self, rank: int, incarnation: int, pause: float = 0.0) -> Rank:
        """Start rank ``rank`` with the env its pod would have; its annotations file as the
        test last wrote it."""
        env = pod_env(
            self.cluster,
            self.name,
            rank,
            self.world,
            self.node(rank),
            self.spec,
            incarnation,
            self.annotations(rank),
        )
        env |= {
            "MATRIXPOOL_SIM_STEPS": str(self.steps),
            "MATRIXPOOL_SIM_STEP_SECONDS": str(pause),
            "MATRIXPOOL_TORCH_WIDTH": str(WIDTH),
            "MATRIXPOOL_TORCH_TIMEOUT_SECONDS": str(DEADLINE),
            "MASTER_ADDR": "127.0.0.1",  # rank 0's name in a pod
            "MASTER_PORT": str(self.port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world),
            "LOCAL_RANK": "0",
            "GLOO_SOCKET_IFNAME": "lo",  # gloo's own sockets on loopback too
        }
        run = f"{self.name}-{rank}-{len(self.ranks)}"
        out, err = self.cluster.root / f"{run}.out", self.cluster.root / f"{run}.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "matrixpool.devcluster.torch_trainer"],
                cwd=ROOT,
                env=env,
                stdout=stdout,
                stderr=stderr,
            )
        self.ranks.append(Rank(rank, process, out, err))
        return self.ranks[-1]

    def restore(self, rank: int, value: str) -> None:
        """Set the rank's ``matrixpool.dev/restore`` annotation, as a recovery does."""
        annotate(self.annotations(rank), {labels.RESTORE: value})

    def committed(self) -> int | None:
        """The newest step committed for every rank, as the operator reads it."""
        with self.cluster.client(self.node(0), self.name, 0, self.world) as reader:
            return reader.latest()

    def stop(self) -> None:
        for rank in self.ranks:
            rank.kill()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: torchrun's MASTER_PORT for one run of a gang."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class Gang:
    """A job of DCP test trainers (``tests/torch/dcp_worker.py``), one process per rank,
    joined by torchrun's env:// rendezvous on 127.0.0.1; rank r on NODES[r] unless moved."""

    cluster: Cluster
    name: str  # the job (its UID to the daemons)
    spec: dict[str, Any]  # spec.checkpoint
    world: int = 2

    def annotations(self, rank: int) -> Path:
        return self.cluster.root / f"{self.name}-{rank}.annotations"

    def restore(self, value: str) -> None:
        """Every rank's ``matrixpool.dev/restore`` annotation, as a recovery writes it."""
        for rank in range(self.world):
            annotate(self.annotations(rank), {labels.RESTORE: value})

    def run(
        self,
        *args: str,
        incarnation: int,
        nodes: Sequence[str] = NODES,
        failing: Sequence[int] = (),
    ) -> list[list[dict[str, Any]]]:
        """Run ``python -m tests.torch.dcp_worker ARGS`` as every rank at once (rank r's daemon
        on ``nodes[r]``); each rank's JSON lines. Every rank must exit 0 but those in
        ``failing``, which must not."""
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(self.world),
            "GLOO_SOCKET_IFNAME": "lo",  # gloo's own sockets on loopback too
        }
        processes = []
        for rank in range(self.world):
            pod = pod_env(
                self.cluster,
                self.name,
                rank,
                self.world,
                nodes[rank],
                self.spec,
                incarnation,
                self.annotations(rank),
            )
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.torch.dcp_worker", *args],
                    cwd=ROOT,
                    env=pod | env | {"RANK": str(rank), "LOCAL_RANK": "0"},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        return [self._finish(rank, p, rank in failing) for rank, p in enumerate(processes)]

    def _finish(
        self, rank: int, process: subprocess.Popen[bytes], failing: bool
    ) -> list[dict[str, Any]]:
        try:
            out, err = process.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate(timeout=30)
        tail = err.decode(errors="replace")[-4000:]
        if failing:
            assert process.returncode != 0, f"rank {rank} was to fail but exited 0"
        else:
            assert process.returncode == 0, f"rank {rank} exited {process.returncode}:\n{tail}"
        return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


@pytest.fixture
def daemons(cluster: Cluster) -> Cluster:
    """Two daemons, each the other's tier-1 peer, with room for a few 25 MB shards."""
    for name in NODES:
        cluster.start(name, (), "--memory-bytes", "1Gi")
    for name in NODES:
        cluster.set_peers(name, [n for n in NODES if n != name])
    return cluster


@pytest.fixture
def new_job(daemons: Cluster) -> Iterator[Callable[..., Job]]:
    """Make a job: ``new_job(name, steps=..., spec=...)``, its MASTER_PORT free now; its ranks
    are killed at the end of the test whatever happened."""
    made: list[Job] = []

    def make(name: str, steps: int, spec: dict[str, Any]) -> Job:
        made.append(Job(daemons, name, 2, steps, spec, free_port()))
        return made[-1]

    try:
        yield make
    finally:
        for job in made:
            job.stop()
