"""Time-sharing transitions on the real local control plane with `matrixpool sim`: seconds from a
window boundary to the new split fully in place when 320 cards change hands, with the time spent
waiting for the checkpoint, evicting and placing shown apart; against a same-run baseline, the
seconds to place the same 320-card InferenceService on free cards.

One 384-card supernode (48 nodes x 8, no spare). Night: no inference, a 40-rank x 8-card
night-only TrainingJob (320 cards) trains with the real checkpoint daemons. Day (a 30-minute
window on a 60x clock): inference may hold 320 cards, an InferenceService of 8 prefill
(1 x 8 cards) and 8 decode (4 x 8 cards) instances, minReplicas 0. So at the day boundary the
job is asked to checkpoint (the sim's ranks step every 2 s and checkpoint every 2 steps, so
that their kept steps overlap and a step every rank holds answers the request), evicted, and
inference scales up onto its 320 cards; at the night
boundary inference scales down and the job resumes from its checkpoint.

    .venv/bin/python benchmarks/timeshare.py --json

Prints one JSON object; docs/benchmarks.md records the figures with this command. The
durations are the operator's own (SuperNode status.transition, real seconds from the
boundary); the baseline is measured here, from applying the service to every pod bound.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from matrixpool.devcluster import binaries, cluster, topology, trainer
from matrixpool.k8s import client as k8s_client

NAMESPACE = "bench"
CARD = "huawei.com/Ascend910"
GROUP, VERSION = "matrixpool.dev", "v1alpha1"
SPEED = 60  # the operator's clock: one real second is a minute
# The clock starts at 07:20 UTC: the day window (08:00-08:30) starts 40 real seconds later.
CLOCK_START = "2026-11-30T07:20:00+00:00"
GRACE = 30  # checkpointGraceSeconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    args = parser.parse_args()
    say = (lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr))
    with tempfile.TemporaryDirectory(prefix="mp-bench-ts-") as name:
        folder = Path(name)
        local = cluster.Cluster(folder, progress=say)
        local.up(topology.Shape(supernodes=1), crds=binaries.repo_root() / "crds")
        env = {**os.environ, "KUBECONFIG": str(local.kubeconfig)}
        port = str(cluster.free_ports(1)[0])  # other sims on this machine use the default
        sim = spawn(
            [sys.executable, "-m", "matrixpool.cli", "sim", "--port", port],
            env,
            folder / "sim.log",
            ["--folder", str(folder / "sim")],
        )
        operator_env = {
            **env,
            "MATRIXPOOL_LOG_FORMAT": "json",
            "MATRIXPOOL_CKPT_SECRET_FILE": str(folder / "sim" / "secret"),
            "MATRIXPOOL_CKPT_DAEMON_PORT": port,
        }
        run = [sys.executable, "-m", "matrixpool.cli", "run"]
        operators = [spawn(run, operator_env, folder / "operator.log")]

        def restart() -> None:
            """A fresh operator whose scaled clock starts now at CLOCK_START (night)."""
            os.killpg(operators[-1].pid, signal.SIGTERM)
            operators[-1].wait(timeout=60)
            clocked = {
                **operator_env,
                "MATRIXPOOL_CLOCK_START": CLOCK_START,
                "MATRIXPOOL_CLOCK_SPEED": str(SPEED),
            }
            operators.append(spawn(run, clocked, folder / "operator.log"))

        try:
            figures = measure(k8s_client.from_kubeconfig(local.kubeconfig), restart, say)
        finally:
            for process in (operators[-1], sim):
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=60)
            local.down(quiet=True)
    print(json.dumps(figures, indent=None if args.json else 2))
    return 0


def spawn(
    argv: list[str], env: dict[str, str], log: Path, extra: list[str] | None = None
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv + (extra or []),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def measure(api: k8s_client.Api, restart: Any, say: Any) -> dict[str, Any]:
    api.core.create_namespace({"metadata": {"name": NAMESPACE}})
    api.custom.create_cluster_custom_object(GROUP, VERSION, "supernodes", supernode(sharing=False))
    wait(lambda: bool(cards(api).get("total")), 60)

    say("baseline: the 320-card InferenceService placed on free cards")
    begun = time.perf_counter()
    create(api, "inferenceservices", inference_service())
    wait(lambda: bound(api, "chat") == 40, 120)
    baseline = time.perf_counter() - begun
    api.custom.delete_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, "inferenceservices", "chat"
    )
    wait(lambda: pods(api, "chat") == 0, 120)

    say("night: time-sharing on, the night-only job on 320 cards, then the day boundary")
    restart()
    started = time.perf_counter()
    body = api.custom.get_cluster_custom_object(GROUP, VERSION, "supernodes", "sn-0")
    body["spec"] = supernode(sharing=True)["spec"]
    api.custom.replace_cluster_custom_object(GROUP, VERSION, "supernodes", "sn-0", body)
    create(api, "trainingjobs", training_job())
    create(api, "inferenceservices", inference_service())
    wait(lambda: bound(api, "nightly") == 40, 60)
    say(f"  night job bound {time.perf_counter() - started:.1f} s after the operator started")
    to_day = transition(api, "day", 120)
    committed = suspension(api)
    say("day → night: inference down, the job resumes from its checkpoint")
    to_night = transition(api, "night", 120)
    resumed = wait_value(lambda: resumed_record(api), 60)
    to_day_work = (to_day["seconds"] or 0) - (to_day["checkpointSeconds"] or 0)
    return {
        "cards_changing_hands": 320,
        "checkpoint_grace_seconds": GRACE,
        "night_to_day_seconds": to_day["seconds"],
        "night_to_day_checkpoint_seconds": to_day["checkpointSeconds"],
        "night_to_day_eviction_seconds": to_day["evictionSeconds"],
        "night_to_day_placement_seconds": to_day["placementSeconds"],
        "day_to_night_seconds": to_night["seconds"],
        "day_to_night_eviction_seconds": to_night["evictionSeconds"],
        "day_to_night_placement_seconds": to_night["placementSeconds"],
        "checkpoint_answered": committed["answered"],
        "checkpoint_step": committed.get("step"),
        "restored_step": resumed.get("restoredStep"),
        "baseline_cold_placement_seconds": round(baseline, 3),
        "night_to_day_beyond_checkpoint_vs_baseline": round(to_day_work / baseline, 3),
        "goal_met": to_day_work < 5.0,
    }


def transition(api: k8s_client.Api, window: str, timeout: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        body = api.custom.get_cluster_custom_object(GROUP, VERSION, "supernodes", "sn-0")
        move = (body.get("status") or {}).get("transition") or {}
        return move if move.get("window") == window and move.get("settledAt") else None

    return dict(wait_value(probe, timeout))


def suspension(api: k8s_client.Api) -> dict[str, Any]:
    body = api.custom.get_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, "trainingjobs", "nightly"
    )
    return dict(body["status"]["timeSharing"]["suspensions"][-1])


def resumed_record(api: k8s_client.Api) -> dict[str, Any] | None:
    record = suspension(api)
    return record if record.get("resumedAt") else None


def cards(api: k8s_client.Api) -> dict[str, Any]:
    body = api.custom.get_cluster_custom_object(GROUP, VERSION, "supernodes", "sn-0")
    return dict((body.get("status") or {}).get("cards") or {})


def create(api: k8s_client.Api, plural: str, body: dict[str, Any]) -> None:
    api.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, plural, body)


def pods(api: k8s_client.Api, owner: str) -> int:
    selector = f"matrixpool.dev/job={owner}"
    return len(api.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items)


def bound(api: k8s_client.Api, owner: str) -> int:
    selector = f"matrixpool.dev/job={owner}"
    found = api.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
    return sum(1 for p in found if p.spec.node_name and not p.metadata.deletion_timestamp)


def wait(probe: Any, timeout: float) -> float:
    """Poll ``probe`` every 50 ms; the perf_counter time at which it first held."""
    deadline = time.perf_counter() + timeout
    while not probe():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"not reached within {timeout} s")
        time.sleep(0.05)
    return time.perf_counter()


def wait_value(probe: Any, timeout: float) -> Any:
    deadline = time.perf_counter() + timeout
    while (value := probe()) is None:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"not reached within {timeout} s")
        time.sleep(0.1)
    return value


def supernode(*, sharing: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": "sn-0"}},
        "cardResource": CARD,
        "cardsPerNode": 8,
        "topologyKeys": ["matrixpool.dev/rack"],
        "spares": {"nodes": 0},
    }
    if sharing:
        spec["timeSharing"] = {
            "timezone": "UTC",
            "windows": [
                {"name": "day", "start": "08:00", "end": "08:30", "inferenceCards": 320},
                {"name": "night", "start": "08:30", "end": "08:00", "inferenceCards": 0},
            ],
            "checkpointGraceSeconds": GRACE,
        }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SuperNode",
        "metadata": {"name": "sn-0"},
        "spec": spec,
    }


def training_job() -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": "nightly"},
        "spec": {
            "superNode": "sn-0",
            "replicas": 40,
            "cardsPerReplica": 8,
            "priority": 100,
            "windows": ["night"],
            "checkpoint": {"memory": {"everySteps": 2, "peerReplicas": 1}},
            "template": {"spec": {"containers": [trainer.container(2.0)]}},
        },
    }


def inference_service() -> dict[str, Any]:
    def role(name: str, pods: int) -> dict[str, Any]:
        return {
            "name": name,
            "replicas": 8,
            "minReplicas": 0,
            "podsPerReplica": pods,
            "cardsPerPod": 8,
            "template": {"spec": {"containers": [{"name": "s", "image": "x:1"}]}},
        }

    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": "chat"},
        "spec": {
            "superNode": "sn-0",
            "roles": [role("prefill", 1), role("decode", 4)],
            "ratio": {"prefill": 1, "decode": 1},
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
