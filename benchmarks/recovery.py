"""Fault recovery on the real local control plane with `matrixpool sim`: seconds from injecting a
fault to the operator detecting it, to every rank's pod Running again, and to every rank having
restored the chosen checkpoint (read from the trainers' own logs), for each recovery level, at
384 cards (1 supernode) and 3,072 cards (8 supernodes).

The job under test: 40 ranks x 8 cards on sn-0 (48 nodes, 2 spares), checkpointing to memory
every 2 steps (a step is 0.5 s), to disk every 10, with real checkpoint daemons, one per sn-0
node. At 3,072 cards the other seven supernodes each run a 44-rank job too (pods only, no
trainers), so the operator watches 384 nodes and 348 pods. The faults:

* InPlace: SIGKILL of one rank's trainer process (its pod fails; the node is healthy).
* SpareSwap: one rank's node goes NotReady (kwok), its daemon and memory die with it.
* Reschedule: the same, with ``spec.recovery.levels: [InPlace, Reschedule]``.

Baseline, same run: seconds from applying the job to every rank's trainer running (placement,
binding, kwok, trainer start) — what a recovery would cost without any of the ladder.

    .venv/bin/python benchmarks/recovery.py --json [--scales 384,3072]

``--real-nodes``: the same ladder on real kubelets instead (root): the real-node suite's
cluster, image and chart, the PyTorch example trainer with 263 MiB of model and Adam state per
rank, and a regroup beside the three levels (tests/realnodes/bench_recovery.py says what is
measured); about 15 minutes.

    .venv/bin/python benchmarks/recovery.py --json --real-nodes

Prints one JSON object; docs/benchmarks.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matrixpool.devcluster import binaries, cluster, faults, topology, trainer
from matrixpool.k8s import client as k8s_client

NAMESPACE = "bench"
CARD = "huawei.com/Ascend910"
GROUP, VERSION = "matrixpool.dev", "v1alpha1"
RANKS = 40
FILLER_RANKS = 44
STEP_SECONDS = 0.5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--scales", default="384,3072", help="cards in the cluster, 384 each SN")
    parser.add_argument("--real-nodes", action="store_true", help="on real kubelets (root)")
    args = parser.parse_args()
    if args.real_nodes:
        return real_nodes(args.json)
    say = (lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr))
    figures: dict[str, Any] = {"ranks": RANKS, "cards_per_rank": 8, "scales": {}}
    for cards in (int(c) for c in args.scales.split(",")):
        figures["scales"][str(cards)] = run_scale(cards // 384, say)
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)  # the machine is shared
    print(json.dumps(figures, indent=None if args.json else 2))
    return 0


def real_nodes(quiet: bool) -> int:
    """The real-node ladder: pytest runs tests/realnodes/bench_recovery.py (its cluster and chart
    are the real-node suite's fixtures) and leaves the figures in a file; they are printed."""
    repo = binaries.repo_root()
    with tempfile.TemporaryDirectory(prefix="mp-bench-rec-real-") as name:
        out = Path(name) / "figures.json"
        argv = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
        argv.append(str(repo / "tests" / "realnodes" / "bench_recovery.py"))
        done = subprocess.run(
            argv,
            cwd=repo,
            env={
                **os.environ,
                "MATRIXPOOL_BENCH_OUT": str(out),
                # tier 1 for two steps of a 263 MiB rank and a peer's copy (the suite's 512Mi
                # holds 256 MiB)
                "MATRIXPOOL_REALNODES_HELM_SET": "checkpointDaemon.memory=3Gi",
            },
            stdout=subprocess.DEVNULL if quiet else sys.stderr,
            check=False,
        )
        if done.returncode or not out.exists():
            print(f"the real-node run failed (pytest exited {done.returncode})", file=sys.stderr)
            return 1
        print(out.read_text())
    return 0


def run_scale(supernodes: int, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mp-bench-rec-") as name:
        folder = Path(name)
        local = cluster.Cluster(folder, progress=say)
        local.up(topology.Shape(supernodes=supernodes), crds=binaries.repo_root() / "crds")
        env = {**os.environ, "KUBECONFIG": str(local.kubeconfig)}
        sim_folder = folder / "sim"
        port = str(cluster.free_ports(1)[0])  # the daemons', told to the operator too
        sim = spawn(
            [
                "sim",
                "--supernode",
                "sn-0",
                "--folder",
                str(sim_folder),
                "--port",
                port,
            ],
            env,
            folder / "sim.log",
        )
        operator = None
        try:
            wait(lambda: (sim_folder / "serving").exists(), 300, "the sim's daemons")
            token = {
                "MATRIXPOOL_CKPT_SECRET_FILE": str(sim_folder / "secret"),
                "MATRIXPOOL_CKPT_DAEMON_PORT": port,
            }
            operator = spawn(["run", "--metrics-port", "0"], {**env, **token}, folder / "op.log")
            bench = Bench(local, sim_folder, say)
            return bench.run(supernodes)
        finally:
            for process in (operator, sim):
                if process is not None:
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait(timeout=60)
            local.down(quiet=True)


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "matrixpool.cli", *args],
            env={**env, "MATRIXPOOL_LOG_FORMAT": "json"},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait(probe: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached within {timeout:.0f} s")


class Bench:
    def __init__(self, local: cluster.Cluster, sim: Path, say: Callable[[str], None]) -> None:
        self.local, self.sim, self.say = local, sim, say
        self.api = k8s_client.from_kubeconfig(local.kubeconfig)

    def run(self, supernodes: int) -> dict[str, Any]:
        self.api.core.create_namespace({"metadata": {"name": NAMESPACE}})
        for index in range(supernodes):
            self.supernode(f"sn-{index}", spares=2 if index == 0 else 0)
        for index in range(1, supernodes):
            self.job(f"filler-{index}", f"sn-{index}", FILLER_RANKS)
        started = time.time()
        self.job("llm", "sn-0", RANKS)
        self.say(f"{supernodes * 384} cards: placing a {RANKS}-rank job")
        wait(lambda: len(self.trainers_started()) == RANKS, 300, "every trainer running")
        baseline = time.time() - started
        wait(lambda: (self.status().get("checkpoints") or {}).get("memory"), 120, "checkpoints")
        levels = {}
        levels["InPlace"] = self.measure(1, "InPlace", self.kill_trainer)
        levels["SpareSwap"] = self.measure(2, "SpareSwap", self.node_down)
        self.api.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            "trainingjobs",
            "llm",
            {"spec": {"recovery": {"levels": ["InPlace", "Reschedule"]}}},
        )
        levels["Reschedule"] = self.measure(3, "Reschedule", self.node_down)
        for figures in levels.values():
            figures["restored_vs_baseline"] = round(figures["restored_seconds"] / baseline, 2)
        return {
            "cards": supernodes * 384,
            "nodes": supernodes * 48,
            "baseline_place_and_start_seconds": round(baseline, 2),
            "levels": levels,
        }

    # ---- the workloads -----------------------------------------------------------------------

    def supernode(self, name: str, spares: int) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "SuperNode",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"matchLabels": {"matrixpool.dev/supernode": name}},
                "cardResource": CARD,
                "cardsPerNode": 8,
                "topologyKeys": ["matrixpool.dev/rack"],
                "spares": {"nodes": spares},
            },
        }
        self.api.custom.create_cluster_custom_object(GROUP, VERSION, "supernodes", body)

    def job(self, name: str, supernode: str, ranks: int) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TrainingJob",
            "metadata": {"name": name},
            "spec": {
                "superNode": supernode,
                "replicas": ranks,
                "cardsPerReplica": 8,
                "template": {"spec": {"containers": [trainer.container(STEP_SECONDS)]}},
                "checkpoint": {
                    "memory": {"everySteps": 2, "peerReplicas": 1},
                    "local": {"everySteps": 10},
                },
            },
        }
        self.api.custom.create_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "trainingjobs", body
        )

    def status(self) -> dict[str, Any]:
        body = self.api.custom.get_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, "trainingjobs", "llm"
        )
        return dict(body.get("status") or {})

    def pods(self) -> dict[int, Any]:
        items = self.api.core.list_namespaced_pod(
            NAMESPACE, label_selector="matrixpool.dev/job=llm"
        ).items
        return {
            int(p.metadata.labels["matrixpool.dev/rank"]): p
            for p in items
            if not p.metadata.deletion_timestamp
        }

    # ---- what the trainers say ------------------------------------------------------------------

    def lines(self) -> list[dict[str, Any]]:
        found = []
        for path in (self.sim / "trainers").glob(f"*.{NAMESPACE}.llm-*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        found.append(json.loads(line))
                    except ValueError:
                        continue
        return found

    def trainers_started(self) -> set[int]:
        return {int(line["rank"]) for line in self.lines() if "restored" in line}

    def restored(self, recovery: str) -> dict[int, dict[str, Any]]:
        return {
            int(line["rank"]): line
            for line in self.lines()
            if line.get("recovery") == recovery and line.get("restored") is not None
        }

    # ---- faults ------------------------------------------------------------------------------

    def kill_trainer(self) -> Callable[[], None]:
        pod = self.pods()[5]
        pid = self.sim / "trainers" / f"{pod.spec.node_name}.{NAMESPACE}.{pod.metadata.name}.pid"
        os.kill(int(pid.read_text()), signal.SIGKILL)
        return lambda: None

    def node_down(self) -> Callable[[], None]:
        node = self.pods()[7].spec.node_name
        faults.node_down(self.local.kubeconfig, node)
        return lambda: faults.node_up(self.local.kubeconfig, node)

    def measure(self, count: int, level: str, inject: Callable[[], Callable[[], None]]) -> Any:
        before = (self.status().get("checkpoints") or {}).get("memory")
        self.say(f"  {level}: injecting the fault (committed step {before})")
        injected = time.time()
        undo = inject()
        try:
            entry = wait(lambda: self.finished(count), 180, f"recovery {count}")
            lines = wait(
                lambda: (r := self.restored(entry["id"])) and len(r) == RANKS and r,
                120,
                f"every rank restored for {entry['id']}",
            )
        finally:
            undo()
        if entry["level"] != level:
            raise RuntimeError(f"expected {level}, the operator chose {entry['level']}: {entry}")
        restored = max(float(line["t"]) for line in lines.values())
        figures = {
            "detection_seconds": round(_epoch(entry["detectedAt"]) - injected, 2),
            "running_seconds": round(_epoch(entry["recoveredAt"]) - injected, 2),
            "restored_seconds": round(restored - injected, 2),
            "restored_step": entry["restoredStep"],
            "lost_steps": entry["lostSteps"],
            "sources": sorted({str(line["source"]).split(":")[0] for line in lines.values()}),
            "intact": all(line.get("intact") for line in lines.values()),
        }
        self.say(f"  {level}: {figures}")
        wait(
            lambda: (
                (self.status().get("checkpoints") or {}).get("memory", -1)
                > entry["restoredStep"] + 4
            ),
            120,
            "training past the restored step",
        )
        return figures

    def finished(self, count: int) -> dict[str, Any] | None:
        current = self.status()
        entries = current.get("recoveries") or []
        if len(entries) >= count and not current.get("recovering"):
            return dict(entries[count - 1])
        return None


def _epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


if __name__ == "__main__":
    sys.exit(main())
