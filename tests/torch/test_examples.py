"""The PyTorch examples as a user runs them (issue 30, item 4): the script in each example's
ConfigMap (examples/pytorch-ddp.yaml, examples/pytorch-fsdp.yaml), run by real ``torchrun``
with no flags, one torchrun per "pod", with the environment the operator writes into a rank's
pod (torchrun's PET_* from ``matrixpool.k8s.pods.Rendezvous``, the pod contract's MATRIXPOOL_*)
against real checkpoint daemons. Rank 0's node is lost after a checkpoint; the recovery moves
rank 0 to a spare node and names the step in the restore annotation; both ranks restart and
end with the parameters of a run that never failed.

Not here: cluster DNS (MASTER_ADDR is 127.0.0.1 instead of rank 0's name: no resolver on this
machine serves cluster.local outside a cluster) and the operator itself (tests/realnodes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from matrixpool.k8s import pods
from matrixpool_recovery import restore as restore_codec
from tests.checkpoint.conftest import ROOT, Cluster
from tests.torch.conftest import DEADLINE, annotate, free_port, pod_env, require

torch = require("torch")

EXAMPLES = ROOT / "examples"
SPEC = {"memory": {"everySteps": 4, "peerReplicas": 1}}
FIRST, SECOND = 1_000, 2_000  # incarnations: the first run, the recovery's
STEPS = 12
WIDTH = "64"


def script(example: str, folder: Path) -> Path:
    """The training script as the example's ConfigMap ships it (the same text as
    examples/pytorch/<name>.py, which the test checks too)."""
    config_map = next(
        d for d in yaml.safe_load_all((EXAMPLES / example).read_text()) if d["kind"] == "ConfigMap"
    )
    [(name, text)] = config_map["data"].items()
    assert text == (EXAMPLES / "pytorch" / name).read_text(), f"{example} ships another {name}"
    path = folder / name
    path.write_text(text)
    return path


def torchrun(
    cluster: Cluster,
    path: Path,
    job: str,
    nodes: tuple[str, str],
    steps: int,
    every: int,
    incarnation: int,
) -> list[list[dict[str, Any]]]:
    """Each rank's JSON lines: ``torchrun <path>`` per rank, as its pod runs it."""
    port = free_port()
    processes = []
    for rank, node in enumerate(nodes):
        rendezvous = pods.Rendezvous(
            job=job, namespace="ns", rank=rank, replicas=2, port=port, procs_per_replica=1
        )
        torchrun_env = rendezvous.env() | {"PET_MASTER_ADDR": "127.0.0.1"}
        annotations = cluster.root / f"{job}-{rank}.annotations"
        env = pod_env(cluster, job, rank, 2, node, SPEC, incarnation, annotations)
        env |= {k: v for k, v in torchrun_env.items() if k.startswith("PET_")}
        env |= {"STEPS": str(steps), "SAVE_EVERY": str(every), "WIDTH": WIDTH}
        env |= {"GLOO_SOCKET_IFNAME": "lo"}
        processes.append(
            subprocess.Popen(
                [str(Path(sys.executable).with_name("torchrun")), str(path)],
                cwd=path.parent,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    ranks = []
    for rank, process in enumerate(processes):
        try:
            out, err = process.communicate(timeout=3 * DEADLINE)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate(timeout=30)
        tail = err.decode(errors="replace")[-3000:]
        assert process.returncode == 0, f"rank {rank} exited {process.returncode}:\n{tail}"
        ranks.append([json.loads(x) for x in out.decode().splitlines() if x.startswith("{")])
    return ranks


def finished(ranks: list[list[dict[str, Any]]]) -> str:
    [digest] = {line["digest"] for lines in ranks for line in lines if line.get("finished")}
    return str(digest)


@pytest.mark.parametrize("example", ["pytorch-ddp.yaml", "pytorch-fsdp.yaml"])
def test_the_example_restores_after_a_spare_swap_to_the_fault_free_parameters(
    daemons: Cluster, tmp_path: Path, example: str
) -> None:
    path = script(example, tmp_path)
    job = f"ml.{example.removesuffix('.yaml')}"
    reference = torchrun(daemons, path, job + "-ref", ("node-a", "node-b"), STEPS, 0, FIRST)
    first = torchrun(daemons, path, job, ("node-a", "node-b"), 8, 4, FIRST)
    assert all(line.get("restored") is None for lines in first for line in lines)
    daemons.kill("node-a")  # rank 0's node is lost with its memory
    daemons.start("node-c", ("node-b",), "--memory-bytes", "1Gi")  # the spare node's daemon
    daemons.set_peers("node-b", ["node-c"])
    value = restore_codec.restore_value(
        8, [daemons.address("node-b")], "r1", incarnation=SECOND, of=FIRST
    )
    for rank in range(2):
        annotate(daemons.root / f"{job}-{rank}.annotations", {"matrixpool.dev/restore": value})
    second = torchrun(daemons, path, job, ("node-c", "node-b"), STEPS, 4, FIRST)
    for lines in second:
        assert [line["restored"] for line in lines if "restored" in line] == [8]
    assert finished(second) == finished(reference)
