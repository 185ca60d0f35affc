"""Fixtures of the multi-process checkpoint tests: daemons and trainers on loopback.

``Cluster`` starts one ``matrixpool-ckpt-daemon`` process per simulated node (its own memory
and data directories under the test's tmp_path, the cluster secret in a 0600 file, tier 3 under
``<tmp_path>/persistent``) and one trainer process per rank (``tests/checkpoint/trainer.py``),
each with its job's token. No Kubernetes control plane is involved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from matrixpool_recovery import Checkpointer, CheckpointSpec, credentials, wire

ROOT = Path(__file__).resolve().parents[2]
SECRET = "test-cluster-secret"  # what the chart's Secret holds; daemons and the operator only
OPERATOR = credentials.operator_token(SECRET)  # peers, pins, deletes, every job
START_DEADLINE = 30.0  # seconds a daemon may take to start serving
RUN_DEADLINE = 90.0  # seconds a trainer process may take


def job_token(job: str) -> str:
    """The token a trainer of `job` is given: it opens that job's checkpoints only."""
    return credentials.job_token(SECRET, job)


@dataclass
class Node:
    """One simulated node: its daemon process and directories."""

    name: str
    process: subprocess.Popen[bytes]
    address: str  # host:port the daemon serves on
    memory_dir: Path  # tier 1
    data_dir: Path  # tier 2
    log: Path  # the daemon's stderr


@dataclass
class Cluster:
    """Daemons by node name, started and stopped by the test."""

    root: Path
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def secret_file(self) -> Path:
        path = self.root / "secret"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(SECRET + "\n")
        return path

    @property
    def persistent(self) -> Path:
        """The daemons' --persistent-root: tier-3 URIs must resolve inside it."""
        return self.root / "persistent"

    def start(self, name: str, peers: Sequence[str] = (), *extra: str) -> Node:
        ready = self.root / f"{name}.ready"
        log = self.root / f"{name}.log"
        args = [sys.executable, "-m", "matrixpool_recovery.daemon", "--listen", "127.0.0.1:0"]
        args += ["--node", name, "--secret-file", str(self.secret_file)]
        args += ["--ready-file", str(ready), "--persistent-root", str(self.persistent)]
        args += ["--memory-dir", str(self.root / name / "memory")]
        args += ["--data-dir", str(self.root / name / "disk"), "--memory-bytes", "256Mi"]
        args += ["--memory-headroom", "16Mi"]
        args += [arg for peer in peers for arg in ("--peer", self.nodes[peer].address)]
        with open(log, "wb") as stderr:
            process = subprocess.Popen([*args, *extra], stderr=stderr, cwd=ROOT)
        node = Node(name, process, "", self.root / name / "memory", self.root / name / "disk", log)
        self.nodes[name] = node
        node.address = self._wait_ready(node, ready)
        return node

    def _wait_ready(self, node: Node, ready: Path) -> str:
        deadline = time.monotonic() + START_DEADLINE
        while time.monotonic() < deadline:
            if ready.exists():
                return ready.read_text()
            if node.process.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"daemon {node.name} did not start:\n{node.log.read_text()}")

    def ring(self, racks: dict[str, Sequence[str]]) -> None:
        """Start every node; each one's peers are the nodes of the other racks."""
        for members in racks.values():
            for name in members:
                self.start(name)  # without peers: they are set once every daemon serves
        for rack, members in racks.items():
            others = [n for r, ns in racks.items() if r != rack for n in ns]
            for index, name in enumerate(members):
                rotated = others[index:] + others[:index]
                self.set_peers(name, rotated)

    def set_peers(self, name: str, peers: Sequence[str]) -> None:
        endpoint = wire.Endpoint(self.nodes[name].address, OPERATOR)
        wire.request(endpoint, "POST", "/v1/peers", {"peers": [self.address(p) for p in peers]})

    def others(self, name: str) -> list[str]:
        """Addresses of every other daemon, lost ones too: what the operator tells trainers."""
        return [n.address for n in self.nodes.values() if n.name != name]

    def address(self, name: str) -> str:
        return self.nodes[name].address

    def kill(self, name: str) -> None:
        """kill -9: the node is lost."""
        node = self.nodes[name]
        os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait(timeout=30)

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.process.poll() is None:
                node.process.terminate()
        for node in self.nodes.values():
            try:
                node.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=30)

    def client(self, node: str, job: str, rank: int, world: int, **kwargs: Any) -> Checkpointer:
        """A trainer client inside the test process."""
        token = kwargs.pop("token", job_token(job))
        kwargs.setdefault("peers", self.others(node))
        return Checkpointer(job, rank, world, self.address(node), token, **kwargs)


def trainers(
    cluster: Cluster,
    action: str,
    job: str,
    placement: dict[int, str],
    spec: dict[str, Any],
    *extra: str,
    world: int = 0,
) -> dict[int, list[dict[str, Any]]]:
    """Run one trainer process per rank at once (rank -> node); their JSON lines by rank.

    `world` is the job's size (default: the ranks placed).
    """
    world = world or len(placement)
    processes = {}
    for rank, node in placement.items():
        args = [sys.executable, "-m", "tests.checkpoint.trainer", action, "--job", job]
        args += ["--rank", str(rank), "--world", str(world), "--daemon", cluster.address(node)]
        args += ["--spec", json.dumps(spec), *extra]
        args += ["--peers", ",".join(cluster.others(node))]
        env = {**os.environ, "MATRIXPOOL_CKPT_TOKEN": job_token(job)}  # not on the command line
        processes[rank] = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    results: dict[int, list[dict[str, Any]]] = {}
    for rank, process in processes.items():
        out, err = process.communicate(timeout=RUN_DEADLINE)
        lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        assert process.returncode in (0, 3), f"rank {rank} crashed:\n{err.decode()}"
        results[rank] = lines
    return results


def spec_json(**tiers: Any) -> dict[str, Any]:
    """spec.checkpoint of a TrainingJob, e.g. spec_json(memory=10, peers=1, local=20)."""
    spec: dict[str, Any] = {}
    if "memory" in tiers:
        spec["memory"] = {"everySteps": tiers["memory"], "peerReplicas": tiers.get("peers", 1)}
    if "local" in tiers:
        spec["local"] = {"everySteps": tiers["local"]}
    if "persistent" in tiers:
        spec["persistent"] = {"everySteps": tiers["persistent"], "uri": tiers["uri"]}
    return spec


def to_spec(spec: dict[str, Any]) -> CheckpointSpec:
    return CheckpointSpec.from_job(spec)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    built = Cluster(tmp_path)
    try:
        yield built
    finally:
        built.stop()
