"""``matrixpool demo`` (``make demo``): the local cluster, the operator, the examples, and what
``kubectl get matrixpool`` then shows. Narrates every step with its measured time.

What it shows today: two supernodes pooled and reported, the DeepSeek-style service placed on
sn-0, training placed on what is left or waiting with a reason. Time-sharing transitions and
recoveries join the narration as they land (issues 5 and 6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from matrixpool import clock
from matrixpool.devcluster import binaries, cluster, topology

DEMO_SHAPE = topology.Shape(supernodes=2)
DEMO_NAMESPACE = "matrixpool-demo"


def run(*, keep: bool = False) -> int:
    started = clock.SYSTEM.monotonic()
    local = cluster.Cluster(progress=_say)
    root = binaries.repo_root()
    _step("starting the local control plane (2 supernodes × 48 nodes × 8 cards)")
    local.up(DEMO_SHAPE, crds=root / "crds")
    operator = _start_operator(local)
    try:
        _step(f"applying examples/ (namespaced ones into {DEMO_NAMESPACE})")
        cluster.kubectl(local, "create", "namespace", DEMO_NAMESPACE, check=False)
        for path in sorted((root / "examples").glob("*.yaml")):
            namespaced = "supernode" not in path.name
            args = ["apply", "-f", str(path)] + (["-n", DEMO_NAMESPACE] if namespaced else [])
            print(cluster.kubectl(local, *args).stdout.strip())
        _step("waiting for the operator to report every SuperNode")
        _wait_reported(local)
        _step("waiting for every workload to be placed, or to say why it waits")
        _wait_settled(local)
        _step("kubectl get matrixpool -A")
        print(cluster.kubectl(local, "get", "matrixpool", "-A").stdout)
        print(f"demo finished in {clock.SYSTEM.monotonic() - started:.1f} s")
        if keep:
            print(f"the cluster and operator keep running; export KUBECONFIG={local.kubeconfig}")
            print("stop them with: matrixpool cluster down")
        return 0
    finally:
        if not keep:
            operator.terminate()
            operator.wait(timeout=30)
            local.down()


def _start_operator(local: cluster.Cluster) -> subprocess.Popen[bytes]:
    _step("starting the operator (matrixpool run)")
    log = local.folder / "logs" / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(local.kubeconfig), "MATRIXPOOL_LOG_FORMAT": "json"}
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "matrixpool.cli", "run"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"  operator pid {process.pid}, log {log}")
    return process


def _wait_reported(local: cluster.Cluster, timeout: float = 60) -> None:
    deadline = clock.SYSTEM.monotonic() + timeout
    jsonpath = "{range .items[*]}{.metadata.name}={.status.cards.total}{'\\n'}{end}"
    while clock.SYSTEM.monotonic() < deadline:
        rows = cluster.kubectl(local, "get", "supernodes", "-o", f"jsonpath={jsonpath}").stdout
        if rows.strip() and all(line.split("=")[1] for line in rows.split()):
            return
        time.sleep(0.5)
    raise cluster.ClusterError(
        "the operator did not report the SuperNodes; see its log in "
        f"{Path(local.folder) / 'logs' / 'operator.log'}"
    )


def _wait_settled(local: cluster.Cluster, timeout: float = 90) -> None:
    """Until each TrainingJob and InferenceService is bound or has a reason to wait."""
    deadline = clock.SYSTEM.monotonic() + timeout
    while clock.SYSTEM.monotonic() < deadline:
        items = json.loads(
            cluster.kubectl(
                local, "get", "trainingjobs,inferenceservices", "-A", "-o", "json"
            ).stdout
        )["items"]
        if all(_settled(item) for item in items):
            return
        time.sleep(0.5)
    print("  (some workloads are still being placed)")


def _settled(item: dict[str, object]) -> bool:
    status = item.get("status") or {}
    assert isinstance(status, dict)
    kind = "Scheduled" if item.get("kind") == "TrainingJob" else "Ready"
    conditions: list[dict[str, object]] = list(status.get("conditions") or [])
    condition: dict[str, object] = next((c for c in conditions if c.get("type") == kind), {})
    return condition.get("status") == "True" or condition.get("reason") not in (
        None,
        "Waiting",
        "Scheduling",
    )


def _step(text: str) -> None:
    print(f"==> {text}", flush=True)


def _say(line: str) -> None:
    print(line, flush=True)
