"""Time to recover per rung on real nodes (issue 32, item 4), run by
``benchmarks/recovery.py --real-nodes`` (not collected by ``make test``: its name is not
``test_*``). The real-node suite's cluster, image and chart (tests/realnodes/conftest.py); the
example trainer (matrixpool.devcluster.torch_trainer: gloo, DCP on matrixpool_recovery.torch) as
2 ranks of 8 cards on sn-real, its MLP 3392 wide: model and Adam state 263 MiB per rank,
checkpointed to node memory every 2 steps (one peer copy) and to tier 3 every 10.

Faults, in this order, each once the job runs again past the last one's restored step:
InPlace (a trainer container killed), SpareSwap (a rank's node powered off: the rank moves to
the spare), Reschedule (the same with ``recovery.levels: [InPlace, Reschedule]``: the whole
gang placed again), and a regroup (a higher-priority job of 2 nodes arrives where one is free:
the elastic job, at least 1 rank, checkpoints and shrinks to 1). Seconds from the injection to:

* **detected**: the operator saw the fault (``detectedAt``; a regroup: the checkpoint request);
* **decided**: the plan written (``status.recovering`` first seen, polled every 0.2 s; a
  regroup: ``resizes[].startedAt``);
* **running**: every rank's pod bound and Running (``recoveredAt``; a regroup: ``finishedAt``);
* **first step**: the last rank's first training step after it restored (the trainers' clocks).

Writes the figures as JSON to the file ``MATRIXPOOL_BENCH_OUT`` names."""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.integration import framework
from tests.realnodes.conftest import SPARE, Watched, supernode
from tests.realnodes.test_pytorch_on_real_nodes import job
from tests.realnodes.test_regroup_on_real_nodes import urgent

JOB = "torch-bench"
RANKS = 2
WIDTH = 3392  # 2 x (3392² + 3392) parameters, x3 with Adam's moments, 4 bytes: 263 MiB


def state_bytes(width: int = WIDTH) -> int:
    return 2 * (width * width + width) * 3 * 4


def bench_job() -> dict[str, Any]:
    body = job()
    body["metadata"]["name"] = JOB
    spec = body["spec"]
    spec["replicas"], spec["minReplicas"], spec["priority"] = RANKS, 1, 10
    [container] = spec["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    env |= {
        "MATRIXPOOL_SIM_STEPS": "100000",
        "MATRIXPOOL_SIM_STEP_SECONDS": "0",
        "MATRIXPOOL_TORCH_WIDTH": str(WIDTH),
    }
    container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    spec["checkpoint"]["persistent"] = {
        "everySteps": 10,
        "uri": "file:///var/lib/matrixpool/persistent/" + JOB,
    }
    return body


def epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


class Bench:
    def __init__(self, cluster: framework.TestCluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.watched = Watched(cluster, namespace, JOB)
        self.last: int | None = None  # the step the newest recovery restored

    def lines(self) -> dict[int, list[dict[str, Any]]]:
        found = {}
        for rank, pod in self.watched.rank_pods().items():
            out = self.cluster.kubectl(
                "logs", "-n", self.namespace, pod["metadata"]["name"], check=False
            )
            found[rank] = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
        return found

    def first_steps(self, tag: str, ranks: int) -> dict[int, tuple[int, float]] | None:
        """Rank → (step restored for ``tag``, when its first step after it ended)."""
        found = {}
        for rank, lines in self.lines().items():
            restored = None
            for line in lines:
                if line.get("recovery") == tag and line.get("restored") is not None:
                    restored = int(line["restored"])
                elif restored is not None and "loss" in line:
                    found[rank] = (restored, float(line["t"]))
                    break
        return found if len(found) == ranks else None

    def decided(self, count: int) -> float:
        """When the plan of recovery ``count`` was first seen written (polled)."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            now = self.watched.status()
            if now.get("recovering") or len(now.get("recoveries") or []) >= count:
                return time.time()
            time.sleep(0.2)
        raise AssertionError(f"recovery {count} never started")

    def recovery(
        self, count: int, level: str, inject: Callable[[], Callable[[], None]]
    ) -> dict[str, Any]:
        before = self.watched.training(past=(self.last or 0) + 4)["checkpoints"]["memory"]
        injected = time.time()
        undo = inject()
        try:
            decided = self.decided(count)
            entry = self.watched.recovered(count)
            firsts = framework.eventually(
                lambda: self.first_steps(entry["id"], RANKS),
                timeout=240,
                interval=1,
                what=f"the first step after {entry['id']}",
            )
        finally:
            undo()
        assert entry["level"] == level, entry
        self.last = entry["restoredStep"]
        return {
            "detected_seconds": round(epoch(entry["detectedAt"]) - injected, 2),
            "decided_seconds": round(decided - injected, 2),
            "running_seconds": round(epoch(entry["recoveredAt"]) - injected, 2),
            "first_step_seconds": round(max(t for _, t in firsts.values()) - injected, 2),
            "restored_step": entry["restoredStep"],
            "committed_before": before,
            "lost_steps": entry.get("lostSteps"),
        }

    def free_cards(self) -> int:
        body = self.cluster.api.custom.get_cluster_custom_object(
            "matrixpool.dev", "v1alpha1", "supernodes", "sn-real"
        )
        return int(((body.get("status") or {}).get("cards") or {}).get("free") or 0)

    def kill_trainer(self) -> Callable[[], None]:
        pod = self.watched.rank_pods()[1]
        container = pod["status"]["containerStatuses"][0]["containerID"].split("//", 1)[1]
        self.cluster.local.kill_container(pod["spec"]["nodeName"], container)
        return lambda: None

    def power_off(self) -> Callable[[], None]:
        nodes = [p["spec"]["nodeName"] for _, p in sorted(self.watched.rank_pods().items())]
        node = next(n for n in nodes if n != SPARE)  # the operator runs on the spare
        self.cluster.matrixpool("cluster", "fault", "power-off", node)

        def back() -> None:
            self.cluster.matrixpool("cluster", "fault", "power-on", node, check=False)
            framework.eventually(
                lambda: any(
                    c.type == "Ready" and c.status == "True"
                    for c in self.cluster.api.core.read_node(node).status.conditions or []
                ),
                timeout=180,
                what=f"{node} Ready again",
            )

        return back

    def regroup(self) -> dict[str, Any]:
        self.watched.training(past=(self.last or 0) + 4)
        # The powered-off node counts again only once its device plugin re-announced its
        # cards: until then the 2-node job does not fit even after a shrink, and the elastic
        # job would be evicted whole instead.
        framework.eventually(
            lambda: self.free_cards() >= 8, timeout=180, interval=1, what="a free node again"
        )
        injected = time.time()
        self.cluster.kubectl("apply", "-n", self.namespace, "-f", "-", input=json.dumps(urgent(2)))
        shrunk = framework.eventually(
            lambda: next(
                (r for r in self.watched.status().get("resizes") or [] if r.get("finishedAt")),
                None,
            ),
            timeout=300,
            interval=0.5,
            what="the regroup at 1 rank",
        )
        (preempted,) = self.watched.status()["preemptions"]
        firsts = framework.eventually(
            lambda: self.first_steps(f"resize-{shrunk['id']}", shrunk["toReplicas"]),
            timeout=240,
            interval=1,
            what="the first step after the regroup",
        )
        return {
            "detected_seconds": round(epoch(preempted["requestedAt"]) - injected, 2),
            "checkpoint_seconds": preempted.get("checkpointSeconds"),
            "decided_seconds": round(epoch(shrunk["startedAt"]) - injected, 2),
            "running_seconds": round(epoch(shrunk["finishedAt"]) - injected, 2),
            "first_step_seconds": round(max(t for _, t in firsts.values()) - injected, 2),
            "restored_step": shrunk["restoredStep"],
            "from_to": [shrunk["fromReplicas"], shrunk["toReplicas"]],
            "checkpoint": preempted["checkpoint"],
        }


@pytest.mark.timeout(2400)
def test_recovery_time_per_rung_on_real_nodes(
    installed: framework.TestCluster, namespace: str
) -> None:
    cluster = installed
    cluster.kubectl("apply", "-f", "-", input=json.dumps(supernode()))
    started = time.time()
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bench_job()))
    bench = Bench(cluster, namespace)
    first = bench.watched.training(past=1, timeout=600)
    baseline = time.time() - started
    figures: dict[str, Any] = {
        "ranks": RANKS,
        "state_bytes_per_rank": state_bytes(),
        "width": WIDTH,
        "baseline_apply_to_first_checkpoint_seconds": round(baseline, 2),
        "first_checkpoint_step": first["checkpoints"]["memory"],
        "levels": {},
    }
    levels = figures["levels"]
    levels["InPlace"] = bench.recovery(1, "InPlace", bench.kill_trainer)
    print("InPlace", levels["InPlace"], flush=True)
    levels["SpareSwap"] = bench.recovery(2, "SpareSwap", bench.power_off)
    print("SpareSwap", levels["SpareSwap"], flush=True)
    cluster.kubectl(
        "patch", "trainingjob", JOB, "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"recovery": {"levels": ["InPlace", "Reschedule"]}}}),
    )  # fmt: skip
    levels["Reschedule"] = bench.recovery(3, "Reschedule", bench.power_off)
    print("Reschedule", levels["Reschedule"], flush=True)
    levels["Regroup"] = bench.regroup()
    print("Regroup", levels["Regroup"], flush=True)
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)
    out = os.environ.get("MATRIXPOOL_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(figures, f)
    print(json.dumps(figures), flush=True)
