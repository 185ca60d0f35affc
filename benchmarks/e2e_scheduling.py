"""End-to-end scheduling on the real local control plane: seconds from applying a 48-pod × 8-card
TrainingJob to every pod Running (matrixpool places and binds the gang), against seconds for
kube-scheduler to bind 384 plain one-card pods on the same cluster in the same run.

    .venv/bin/python benchmarks/e2e_scheduling.py --json

Prints one JSON object; docs/benchmarks.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from matrixpool.devcluster import binaries, cluster, topology
from matrixpool.k8s import client as k8s_client

NAMESPACE = "bench"
CARD = "huawei.com/Ascend910"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--gang", type=int, default=48, help="pods of 8 cards in the gang")
    parser.add_argument("--plain", type=int, default=384, help="one-card pods for kube-scheduler")
    args = parser.parse_args()
    say = (lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr))
    with tempfile.TemporaryDirectory(prefix="mp-bench-") as folder:
        local = cluster.Cluster(Path(folder), progress=say)
        local.up(topology.Shape(supernodes=1), crds=binaries.repo_root() / "crds")
        operator = start_operator(local, Path(folder))
        try:
            figures = measure(local, args.gang, args.plain, say)
        finally:
            operator.terminate()
            operator.wait(timeout=30)
            local.down(quiet=True)
    print(json.dumps(figures, indent=None if args.json else 2))
    return 0


def start_operator(local: cluster.Cluster, folder: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KUBECONFIG": str(local.kubeconfig), "MATRIXPOOL_LOG_FORMAT": "json"}
    with open(folder / "operator.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "matrixpool.cli", "run"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def measure(local: cluster.Cluster, gang: int, plain: int, say: Any) -> dict[str, Any]:
    api = k8s_client.from_kubeconfig(local.kubeconfig)
    api.core.create_namespace({"metadata": {"name": NAMESPACE}})
    api.custom.create_cluster_custom_object(
        "matrixpool.dev",
        "v1alpha1",
        "supernodes",
        {
            "apiVersion": "matrixpool.dev/v1alpha1",
            "kind": "SuperNode",
            "metadata": {"name": "sn-0"},
            "spec": {
                "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": "sn-0"}},
                "cardResource": CARD,
                "cardsPerNode": 8,
                "topologyKeys": ["matrixpool.dev/rack"],
                "spares": {"nodes": 0},
            },
        },
    )
    wait(lambda: supernode_reported(api), 60)

    say(f"gang: TrainingJob of {gang} pods x 8 cards")
    started = time.perf_counter()
    api.custom.create_namespaced_custom_object(
        "matrixpool.dev", "v1alpha1", NAMESPACE, "trainingjobs", training_job(gang)
    )
    gang_bound = wait(lambda: count(api, "matrixpool.dev/job=llm", bound=True) >= gang, 120)
    gang_bound -= started
    gang_running = wait(lambda: count(api, "matrixpool.dev/job=llm", running=True) >= gang, 120)
    gang_running -= started
    api.custom.delete_namespaced_custom_object(
        "matrixpool.dev", "v1alpha1", NAMESPACE, "trainingjobs", "llm"
    )
    wait(lambda: count(api, "matrixpool.dev/job") == 0, 120)

    say(f"kube-scheduler: {plain} plain pods x 1 card")
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=32) as pool:
        list(
            pool.map(
                lambda i: api.core.create_namespaced_pod(NAMESPACE, plain_pod(i)), range(plain)
            )
        )
    plain_bound = wait(lambda: count(api, "bench=plain", bound=True) >= plain, 300) - started
    plain_running = wait(lambda: count(api, "bench=plain", running=True) >= plain, 300)
    plain_running -= started
    return {
        "gang_pods": gang,
        "gang_cards": gang * 8,
        "gang_seconds_to_bound": round(gang_bound, 3),
        "gang_seconds_to_running": round(gang_running, 3),
        "kube_scheduler_pods": plain,
        "kube_scheduler_seconds_to_bound": round(plain_bound, 3),
        "kube_scheduler_seconds_to_running": round(plain_running, 3),
        "gang_vs_kube_scheduler_running": round(gang_running / plain_running, 3),
        "gang_vs_kube_scheduler_bound": round(gang_bound / plain_bound, 3),
        "goal_met": gang_running < plain_bound,
    }


def supernode_reported(api: k8s_client.Api) -> bool:
    body = api.custom.get_cluster_custom_object("matrixpool.dev", "v1alpha1", "supernodes", "sn-0")
    return bool(((body.get("status") or {}).get("cards") or {}).get("total"))


def count(api: k8s_client.Api, selector: str, *, bound: bool = False, running: bool = False) -> int:
    pods = api.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
    if bound:
        pods = [p for p in pods if p.spec.node_name]
    if running:
        pods = [p for p in pods if p.status.phase == "Running"]
    return len(pods)


def wait(probe: Any, timeout: float) -> float:
    """Poll ``probe`` every 20 ms; the perf_counter time at which it first held."""
    deadline = time.perf_counter() + timeout
    while not probe():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"not reached within {timeout} s")
        time.sleep(0.02)
    return time.perf_counter()


def training_job(pods: int) -> dict[str, Any]:
    return {
        "apiVersion": "matrixpool.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "llm"},
        "spec": {
            "superNode": "sn-0",
            "replicas": pods,
            "cardsPerReplica": 8,
            "template": {"spec": {"containers": [{"name": "t", "image": "x:1"}]}},
        },
    }


def plain_pod(index: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"plain-{index}", "labels": {"bench": "plain"}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "x:1",
                    "resources": {"requests": {CARD: "1"}, "limits": {CARD: "1"}},
                }
            ]
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
