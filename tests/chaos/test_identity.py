"""Identity by UID (issue 11, defect 2) on the real control plane with ``matrixpool sim``: a
TrainingJob that Failed, deleted and created again under the same name is a new job — it runs,
starts from nothing (none of its predecessor's checkpoints), and the predecessor's checkpoints
are deleted from every daemon."""

from __future__ import annotations

import base64
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from matrixpool_recovery import credentials, manifest, wire
from tests.chaos.conftest import CardSampler
from tests.chaos.test_recovery import (
    JOB,
    persistent_dir,
    pods,
    start_job,
    status,
    wait_training,
)
from tests.integration import chart, framework


def uid(cluster: framework.TestCluster, namespace: str) -> str:
    body = cluster.api.custom.get_namespaced_custom_object(
        "matrixpool.dev", "v1alpha1", namespace, "trainingjobs", JOB
    )
    return str(body["metadata"]["uid"])


def jobs_held(cluster: framework.TestCluster, installed: chart.Installed) -> set[str]:
    """Job UIDs any daemon of the chart holds a checkpoint of (asked with the operator's
    credential, as the operator asks)."""
    token = installed.operator_token()
    held: set[str] = set()
    for address in framework.daemon_endpoints(cluster, chart.SYSTEM).values():
        if not address:
            continue
        try:
            answer = wire.request(wire.Endpoint(address, token, timeout=3), "GET", "/v1/inventory")
        except Exception:  # a daemon restarting: the others still tell
            continue
        held |= {manifest.Holding.from_json(s).job for s in answer["shards"]}
    return held


def test_a_failed_job_created_again_under_its_name_runs_from_nothing(
    cluster: framework.TestCluster,
    operator: chart.Installed,
    sim: framework.Sim,
    namespace: str,
    two_supernodes: list[str],
    cards: CardSampler,
    tmp_path: Path,
) -> None:
    start_job(cluster, namespace, tmp_path, replicas=2, max_recoveries=0)
    framework.eventually(
        lambda: wait_training(cluster, namespace, past=4)["checkpoints"].get("persistent"),
        timeout=90,
        what="a tier-3 checkpoint of the first job",
    )
    first = uid(cluster, namespace)
    assert first in jobs_held(cluster, operator)
    pod = pods(cluster, namespace)[0]
    pid = sim.folder / "trainers" / f"{pod.spec.node_name}.{namespace}.{JOB}-0.pid"
    os.kill(int(pid.read_text()), signal.SIGKILL)

    def failed() -> dict[str, Any] | None:
        current = status(cluster, namespace)
        return current if current.get("phase") == "Failed" else None

    framework.eventually(failed, timeout=60, what="the first job Failed")
    cluster.kubectl("delete", "trainingjob", JOB, "-n", namespace, "--wait=true")
    framework.eventually(
        lambda: first not in jobs_held(cluster, operator),
        timeout=60,
        what="the deleted job's checkpoints gone from every daemon",
    )

    recreated = time.time()
    start_job(cluster, namespace, tmp_path, replicas=2, max_recoveries=0)
    second = uid(cluster, namespace)
    assert second != first
    current = wait_training(cluster, namespace, past=2)
    assert not [c for c in current.get("conditions") or [] if c["type"] == "Failed"]
    for rank in (0, 1):
        lines = sim.trainer_lines(namespace, f"{JOB}-{rank}")
        starts = [line for line in lines if "restored" in line and line["t"] >= recreated]
        assert starts, lines
        assert starts[-1]["restored"] is None, f"rank {rank} restored {starts[-1]}"
    assert first not in jobs_held(cluster, operator)
    assert second in jobs_held(cluster, operator)

    # The job's credential: a Secret named by its UID, holding its token and nothing else's,
    # mounted by its pods (which know the job by its UID).
    secret = cluster.api.core.read_namespaced_secret(f"matrixpool-ckpt-{second}", namespace)
    cluster_secret = operator.cluster_secret()
    token = base64.b64decode(secret.data["token"]).decode()
    assert token == credentials.job_token(cluster_secret, second)
    assert secret.metadata.owner_references[0].uid == second
    pod = pods(cluster, namespace)[0]
    env = {e.name: e.value for e in pod.spec.containers[0].env}
    assert env["MATRIXPOOL_JOB"] == second
    assert any(v.secret and v.secret.secret_name == secret.metadata.name for v in pod.spec.volumes)

    # Tier 3: the first job's files stay (Retain, the default); the second asks for Delete.
    framework.eventually(
        lambda: status(cluster, namespace).get("checkpoints", {}).get("persistent"),
        timeout=90,
        what="a tier-3 checkpoint of the second job",
    )
    patch = {"spec": {"checkpoint": {"persistent": {"reclaimPolicy": "Delete"}}}}
    cluster.kubectl(
        "patch", "trainingjob", JOB, "-n", namespace, "--type=merge", "-p", json.dumps(patch)
    )
    assert (persistent_dir(sim, tmp_path) / second).is_dir()
    cluster.kubectl("delete", "trainingjob", JOB, "-n", namespace, "--wait=true")
    framework.eventually(
        lambda: not (persistent_dir(sim, tmp_path) / second).exists(),
        timeout=60,
        what="the second job's tier-3 folder deleted (reclaimPolicy Delete)",
    )
    assert (persistent_dir(sim, tmp_path) / first).is_dir(), (
        "the first job's tier 3 was kept (Retain)"
    )
