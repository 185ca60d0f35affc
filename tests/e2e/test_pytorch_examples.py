"""The PyTorch examples under ``helm install`` and ``matrixpool sim`` (issue 30, acceptance 3):
examples/pytorch-ddp.yaml and pytorch-fsdp.yaml applied as shipped (SuperNode sn-0, the image,
``torchrun`` with no flags, the script from the ConfigMap), only the step count and pace set
through the script's own knobs. The sim runs each rank's ``torchrun`` as a process with the
pod's environment, hostname, resolv.conf and hosts; MASTER_ADDR resolves through the cluster's
CoreDNS. A rank's torchrun is killed mid-run (its workers die with it, as in a container): the
gang restarts in place from the last step every rank committed through DCP, and the job ends
with the parameters of a fault-free ``torchrun --standalone`` run of the same script."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import ci
from tests.e2e.test_chart import apply_supernodes, pid_of, placed, status
from tests.integration import framework
from tests.integration.chart import REPO, Installed
from tests.trainlogs import DIGEST, Losses, first_difference, losses, merged

RANKS = 3
RESTORED = re.compile(r'"restored": (\d+)')
KNOBS = {"STEPS": "120", "STEP_SECONDS": "0.2"}


def shipped(example: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's ConfigMap and TrainingJob, with ``KNOBS`` added to the trainer's env."""
    documents = list(yaml.safe_load_all((REPO / "examples" / example).read_text()))
    config_map = next(d for d in documents if d["kind"] == "ConfigMap")
    job = next(d for d in documents if d["kind"] == "TrainingJob")
    [trainer] = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in trainer.get("env") or []} | KNOBS
    trainer["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return config_map, job


def fault_free(
    config_map: dict[str, Any], job: dict[str, Any], folder: Path, torchrun: Path
) -> tuple[str, Losses]:
    """The same script by ``torchrun --standalone --nproc-per-node=3`` here, nothing saved: its
    digest and its losses."""
    [(name, text)] = config_map["data"].items()
    script = folder / name
    script.write_text(text)
    [trainer] = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in trainer["env"]} | {"SAVE_EVERY": "0", "STEP_SECONDS": "0"}
    done = subprocess.run(
        [str(torchrun), "--standalone", f"--nproc-per-node={RANKS}", str(script)],
        env={"PATH": os.environ["PATH"], "GLOO_SOCKET_IFNAME": "lo", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # torchrun's workers share its stdout: lines may run into each other.
    [digest] = set(DIGEST.findall(done.stdout))
    return str(digest), losses(done.stdout)


def log_of(installed: Installed, pod: Any) -> str:
    """What a rank's pod printed, every run of its container (the sim keeps it per node,
    namespace, pod)."""
    meta = pod.metadata
    name = f"{pod.spec.node_name}.{meta.namespace}.{meta.name}.log"
    return (installed.sim.folder / "trainers" / name).read_text(errors="replace")


def last_line(installed: Installed, pod: Any) -> dict[str, Any]:
    """The last JSON line a rank's pod printed."""
    lines = [json.loads(x) for x in log_of(installed, pod).splitlines() if x[:1] == "{"]
    return lines[-1] if lines else {}


@pytest.mark.parametrize("example", ["pytorch-ddp.yaml", "pytorch-fsdp.yaml"])
def test_the_pytorch_example_runs_under_the_sim_through_a_crash_to_the_fault_free_parameters(
    installed: Installed, namespace: str, tmp_path: Path, example: str
) -> None:
    torchrun = Path(installed.sim.python).with_name("torchrun")
    if not torchrun.exists():
        ci.cannot_run(f"the sim runs from {installed.sim.python}, which has no torch")
    cluster = installed.cluster
    config_map, job = shipped(example)
    name = job["metadata"]["name"]
    apply_supernodes(cluster)
    for body in (config_map, job):
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))
    expected, reference = fault_free(config_map, job, tmp_path, torchrun)

    def trained(past: int) -> bool:
        now = status(cluster, namespace, name)
        step = (now.get("checkpoints") or {}).get("memory")
        return now.get("phase") == "Running" and isinstance(step, int) and step > past

    framework.eventually(lambda: trained(10), timeout=240, what=f"{name} past step 10")
    pods = placed(cluster, namespace, name)
    assert sorted(pods) == list(range(RANKS))
    os.kill(pid_of(installed, pods[1]), signal.SIGKILL)  # rank 1's torchrun

    def ended() -> dict[str, Any] | None:
        now = status(cluster, namespace, name)
        return now if now.get("phase") in ("Succeeded", "Failed") else None

    final = framework.eventually(ended, timeout=300, interval=1, what=f"{name} ended")
    assert final["phase"] == "Succeeded", final
    [entry] = final["recoveries"]
    assert entry["level"] == "InPlace", entry
    assert 1 in entry["ranks"], entry
    assert entry["restoredStep"] >= 10, entry
    pods = placed(cluster, namespace, name)
    printed = merged(*(losses(log_of(installed, pod)) for pod in pods.values()))
    for rank, pod in sorted(pods.items()):
        # Every rank loaded the step the recovery chose (a gang that trained again from step
        # 0 would end with the fault-free parameters too, and show nothing of the restore).
        restored = RESTORED.findall(log_of(installed, pod))
        assert restored == [str(entry["restoredStep"])], (rank, restored, entry)
        line = last_line(installed, pod)
        assert line.get("finished") is True, (rank, line)
        assert line["digest"] == expected, (
            rank,
            line,
            expected,
            entry,
            first_difference(printed, reference),
        )
