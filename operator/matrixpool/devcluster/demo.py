"""``matrixpool demo`` (``make demo``): everything matrixpool does, on one machine, narrated.

Steps, each printed with its measured time (a ticking progress line on every long wait):

1. the local control plane: two CloudMatrix384-class supernodes (2 × 48 nodes × 8 cards);
2. ``helm install`` of the chart (charts/matrixpool/ci/local-values.yaml: the checkpoint
   daemons on, the operator with a fast clock that starts in the day window), and
   ``matrixpool sim --daemons chart`` as the nodes' kubelet: the chart's operator and daemons
   and the simulated trainers run as its processes, with what their pods say;
3. examples/: the SuperNodes, the DeepSeek-style service (prefill + decode EP320) on sn-0, the
   elastic job and the LLM job (which spans sn-1 and sn-0) homed on sn-1, the night-only job on
   sn-0; the training jobs run the simulated trainer in place of their images, and their
   persistent URIs point into the chart's shared persistentPath;
4. a node failure under a training rank (``node-down``) and its recovery;
5. the fast clock's day → night transition on sn-0 (inference shrinks, the night-only job runs);
6. a bad card under a training rank (``cards NODE 3``) and its recovery;
7. the night → day transition (the night-only job checkpoints and is suspended);
8. (not with ``--fast``) a day of chat load on sn-1 compressed into 90 s
   (:mod:`matrixpool.devcluster.daychat`): the service's prefill and decode instances run the
   simulated inference server, the autoscaler follows the load, and its KV cache is reserved
   in sn-1's KV-cache pool (the chart's daemons lend 64Mi each); the replicas every 3 s, then
   failed requests and SLO attainment;
9. ``kubectl matrixpool status`` and ``recoveries``, then the summary: placements, transitions
   (SuperNode ``status.transition`` as observed) and recoveries (TrainingJob
   ``status.recoveries``) with level and lost steps.

The faults hit sn-1, which is not time-shared, so they never race a transition. ``--fast`` (CI)
runs the same story with smaller training jobs (4 ranks each, so no job spans two supernodes),
quicker checkpoints and a faster clock, and without the day of chat load (its minute and a half
would outlast the day window the summary is checked in). ``--summary-json FILE`` writes the
summary as JSON too; ``--keep`` holds everything up after the summary until Ctrl-C. Every
process the demo starts dies with it.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import yaml

from matrixpool import clock
from matrixpool.devcluster import binaries, cluster, daychat, topology, trainer
from matrixpool.kubectl import render, report

DEMO_SHAPE = topology.Shape(supernodes=2)
DEMO_NAMESPACE = "matrixpool-demo"
SHARED = "sn-0"  # the time-shared supernode of examples/
HOME = "sn-1"  # the training supernode the faults hit
RELEASE = "matrixpool"  # the chart's release, as the local cluster's admission policy expects
SYSTEM = "matrixpool-system"  # its namespace
PERSISTENT = "/var/lib/matrixpool/persistent"  # the chart's persistentPath, shared by every node
T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """How one demo run is sized."""

    name: str
    clock_start: str  # ISO instant the operator's time of day starts at (sn-0: Asia/Shanghai)
    clock_speed: float  # the night (10 h) lasts 36000 / speed real seconds
    step_seconds: float  # the sim's seconds per training step
    training: dict[str, dict[str, Any]] = field(default_factory=dict)  # job → spec overrides
    deadline: float = 240  # seconds any one wait may take
    serving: bool = True  # the day of chat load (step 8)

    @property
    def night_seconds(self) -> float:
        return 10 * 3600 / self.clock_speed


FULL = Plan(
    name="full",
    clock_start="2026-06-01T10:00:00+08:00",  # day; night at 22:00 comes 72 s later
    clock_speed=600,
    step_seconds=1.0,
    deadline=300,
)
FAST = Plan(
    name="fast",
    clock_start="2026-06-01T12:00:00+08:00",  # day; night at 22:00 comes 30 s later
    clock_speed=1200,
    step_seconds=0.5,
    serving=False,
    training={
        "finetune-elastic": {"replicas": 4, "minReplicas": 2, "memoryEvery": 4},
        "llm-pretrain": {"replicas": 4, "memoryEvery": 4},
        "nightly-distill": {"replicas": 4},
    },
)
APPLY_ORDER = (  # the service first (it wins the day), then training that fits beside it
    "supernode-cloudmatrix384.yaml",
    "supernode-cloudmatrix384-b.yaml",
    "inferenceservice-deepseek.yaml",
    "trainingjob-elastic.yaml",
    "trainingjob-llm.yaml",
    "trainingjob-night-only.yaml",
)
SKIPPED = {"supernode-nvl72.yaml": "no GPU nodes in the local cluster"}
KV_POOL_PER_NODE = "64Mi"  # sn-1's memoryPool.perNode: the daemons' kvPoolBytes here
AUTOSCALER_PERIOD = "3"  # seconds between the autoscaler's readings (15 by default)


class DemoError(RuntimeError):
    """A step of the demo did not reach its goal in time."""


# ---- the run ---------------------------------------------------------------------------------


def run(*, keep: bool = False, fast: bool = False, summary_json: Path | None = None) -> int:
    plan = FAST if fast else FULL
    demo = Demo(plan, cluster.Cluster(progress=_say, tied=True))
    try:
        demo.play()
        if summary_json is not None:
            _write_json(summary_json, demo.summary)
            print(f"summary JSON written to {summary_json}", flush=True)
        if keep:
            demo.hold()
        return 0
    finally:
        demo.stop()


@dataclass
class Demo:
    plan: Plan
    local: cluster.Cluster
    started: float = field(default_factory=clock.SYSTEM.monotonic)
    steps: list[dict[str, Any]] = field(default_factory=list)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    observer: TransitionObserver | None = None
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    serving: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics_port: int = field(default_factory=lambda: cluster.free_ports(1)[0])
    daemon_port: int = field(default_factory=lambda: cluster.free_ports(1)[0])  # sim and operator
    health_port: int = field(default_factory=lambda: cluster.free_ports(1)[0])

    @property
    def folder(self) -> Path:
        return self.local.folder / "demo"

    # ---- the story ---------------------------------------------------------------------------

    def play(self) -> None:
        print(f"matrixpool demo ({self.plan.name}): {_describe(self.plan)}", flush=True)
        with self.step("starting the local control plane (2 supernodes × 48 nodes × 8 cards)"):
            self.local.up(DEMO_SHAPE)  # the chart installs the CRDs
        with self.step(
            "helm install matrixpool (operator, 96 checkpoint daemons); "
            "matrixpool sim as the nodes' kubelet"
        ) as tick:
            self.helm("install", "--create-namespace")
            self.start_sim()
            self.wait(self.daemons_announced, "96 daemons announced", tick)
            self.wait(self.operator_running, "the chart's operator running", tick)
        with self.step("helm upgrade: the operator's fast clock starts now") as tick:
            before = self.operator_uid()
            self.helm("upgrade", clocked=True)
            self.wait(
                lambda: self.operator_uid() not in (None, before) and self.operator_running(),
                "the operator with the fast clock running",
                tick,
            )
        print(f"  clock starts at {self.plan.clock_start}, {self.plan.clock_speed:g}× fast")
        self.observer = TransitionObserver(self.local)
        self.observer.start()
        with self.step("applying examples/ (namespaced ones into matrixpool-demo)") as tick:
            self.apply_examples(tick)
        self.snapshot("day")
        self.fault_node_down()
        with self.step("day → night on sn-0 (inference shrinks, the night-only job runs)") as tick:
            night = self.wait_transition("night", tick)
            self.wait(partial(self.night_job_ran, night), "nightly-distill running", tick)
        self.narrate_transition(night)
        self.snapshot("night")
        self.fault_bad_card()
        with self.step(
            "night → day on sn-0 (the night-only job checkpoints, inference grows)"
        ) as tick:
            day = self.wait_transition("day", tick, after=night["startedAt"])
        self.narrate_transition(day)
        self.snapshot("day again")
        if self.plan.serving:
            self.serve_a_day()
        with self.step("kubectl matrixpool status"):
            print(self.plugin("status"))
        with self.step(f"kubectl matrixpool recoveries finetune-elastic -n {DEMO_NAMESPACE}"):
            print(self.plugin("recoveries", "finetune-elastic", "-n", DEMO_NAMESPACE))
        self.summarize()

    # ---- steps ---------------------------------------------------------------------------------

    def helm(self, command: str, *extra: str, clocked: bool = False) -> None:
        """``helm install|upgrade matrixpool charts/matrixpool -n matrixpool-system -f
        charts/matrixpool/ci/local-values.yaml`` with free ports; ``clocked``: the operator's
        fast clock too (operator.extraEnv), which starts when its process does."""
        root = binaries.repo_root()
        chart = root / "charts" / "matrixpool"
        clock_env = [
            {"name": clock.START_ENV, "value": self.plan.clock_start},
            {"name": clock.SPEED_ENV, "value": str(self.plan.clock_speed)},
            {"name": "MATRIXPOOL_AUTOSCALER_PERIOD_SECONDS", "value": AUTOSCALER_PERIOD},
        ]
        ports = (
            f"checkpointDaemon.port={self.daemon_port},metrics.port={self.metrics_port},"
            f"operator.healthPort={self.health_port},"
            f"checkpointDaemon.kvPoolBytes={KV_POOL_PER_NODE}"
        )
        helm = binaries.ensure(progress=lambda _: None) / "helm"
        homes = {
            f"HELM_{k}_HOME": str(self.folder / "helm" / k.lower())
            for k in ("CACHE", "CONFIG", "DATA")
        }
        argv = [str(helm), command, RELEASE, str(chart), "--namespace", SYSTEM, *extra]
        argv += ["-f", str(chart / "ci" / "local-values.yaml"), "--set", ports]
        argv += ["--set-json", f"operator.extraEnv={json.dumps(clock_env if clocked else [])}"]
        env = {**os.environ, "KUBECONFIG": str(self.local.kubeconfig), **homes}
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise DemoError(f"helm {command} failed: {done.stderr.strip()}")
        print(f"  helm {command}: release {RELEASE} in {SYSTEM}", flush=True)

    def operator_uid(self) -> str | None:
        """The operator pod's UID; None while there is not exactly one (a rollout)."""
        found = self.get("pods", "-n", SYSTEM, "-l", "app.kubernetes.io/component=operator")
        live = [p for p in found["items"] if not p["metadata"].get("deletionTimestamp")]
        return str(live[0]["metadata"]["uid"]) if len(live) == 1 else None

    def start_sim(self) -> None:
        shutil.rmtree(self.folder / "sim", ignore_errors=True)  # no log of an earlier run
        argv = [sys.executable, "-m", "matrixpool.cli", "sim", "--folder", str(self.folder / "sim")]
        argv += ["--port", str(self.daemon_port), "--daemons", "chart"]
        argv += ["--shared-path", PERSISTENT]  # the chart's persistentPath, on every node
        self.processes["sim"] = self.spawn("sim", argv, {})

    def operator_running(self) -> bool:
        """The chart's operator pod runs its main loop (its log, in the sim's folder)."""
        found = self.get("pods", "-n", SYSTEM, "-l", "app.kubernetes.io/component=operator")
        for pod in found["items"]:
            if pod["metadata"].get("deletionTimestamp") or not pod["spec"].get("nodeName"):
                continue
            name = f"{pod['spec']['nodeName']}.{SYSTEM}.{pod['metadata']['name']}.log"
            log = self.folder / "sim" / "trainers" / name
            if log.exists() and "main loop started" in log.read_text(errors="replace"):
                return True
        return False

    def daemons_announced(self) -> bool:
        found = self.get("leases", "-n", SYSTEM, "-l", "matrixpool.dev/ckpt-daemon=true")
        return len(found["items"]) >= DEMO_SHAPE.node_count

    def apply_examples(self, tick: Ticker) -> None:
        root = binaries.repo_root() / "examples"
        self.kubectl("create", "namespace", DEMO_NAMESPACE, check=False)
        for name, why in SKIPPED.items():
            print(f"  skipped {name}: {why}")
        for name in APPLY_ORDER:
            body = self.adapt(yaml.safe_load((root / name).read_text()))
            scope = [] if body["kind"] == "SuperNode" else ["-n", DEMO_NAMESPACE]
            out = self.kubectl("apply", *scope, "-f", "-", input=yaml.safe_dump(body))
            print(f"  {out.stdout.strip()}  ({_shape(body)})")
            if body["kind"] == "SuperNode":
                continue
            what = f"{body['kind']} {body['metadata']['name']} placed"
            self.wait(partial(self.placed, body), what, tick)
        print(self.kubectl("get", "matrixpool", "-A").stdout.rstrip())

    def adapt(self, body: dict[str, Any]) -> dict[str, Any]:
        """The example as the demo applies it: persistent URIs in the demo's folder, the
        plan's smaller training jobs (--fast), and the simulated trainer (image matrixpool,
        which the sim runs as a process; the example's own image is only named) in place of
        the example's container, stepping every ``step_seconds``."""
        body = copy.deepcopy(body)
        if body["kind"] == "SuperNode" and body["metadata"]["name"] == HOME:
            body["spec"]["memoryPool"] = {"perNode": KV_POOL_PER_NODE}  # what the daemons lend
        if body["kind"] != "TrainingJob":
            return body
        spec = body["spec"]
        [container] = spec["template"]["spec"]["containers"][:1]
        simulated = trainer.container(
            self.plan.step_seconds, container["name"], MATRIXPOOL_EXAMPLE_IMAGE=container["image"]
        )
        if "resources" in container:
            simulated["resources"] = container["resources"]
        spec["template"]["spec"]["containers"] = [simulated]
        name = body["metadata"]["name"]
        persistent = (spec.get("checkpoint") or {}).get("persistent")
        if persistent:
            persistent["uri"] = f"file://{PERSISTENT}/{name}"
        override = dict(self.plan.training.get(name, {}))
        every = override.pop("memoryEvery", None)
        if every is not None and "memory" in spec.get("checkpoint", {}):
            spec["checkpoint"]["memory"]["everySteps"] = every
        spec.update(override)
        return body

    def serve_a_day(self) -> None:
        with self.step(
            f"a day of chat load on {HOME} in 90 s: the autoscaler follows it, the KV pool holds"
            " its prefixes"
        ) as tick:
            body = daychat.service(HOME, "1Gi")
            out = self.kubectl("apply", "-n", DEMO_NAMESPACE, "-f", "-", input=json.dumps(body))
            print(f"  {out.stdout.strip()}  (prefill 1..3 + decode 1..3 instances of 1 card)")
            endpoints = daychat.Endpoints(self.get, DEMO_NAMESPACE)
            self.wait(lambda: all(endpoints.read()), "chat's servers answering", tick)
            day = daychat.play(self.get, DEMO_NAMESPACE)
        print(
            render.table(
                ("SECONDS", "LOAD (RPS)", "RECOMMENDED", "SERVING (PREFILL+DECODE)"),
                (
                    (
                        s.at_s,
                        s.load_rps,
                        ", ".join(f"{k} {v}" for k, v in s.recommended.items()) or "-",
                        f"{s.serving[0]}+{s.serving[1]}",
                    )
                    for s in day.samples
                ),
            )
        )
        summary = day.summary()
        status = self.get("inferenceservice", daychat.NAME, "-n", DEMO_NAMESPACE).get("status")
        kv = (status or {}).get("kvCache") or {}
        self.serving = {
            "sent": summary.sent,
            "failed": summary.failed,
            "attainment": summary.attainment,
            "settledAttainment": round(day.settled_attainment(), 4),
            "ttftP50": summary.ttft_p50_s,
            "kvCache": kv,
            "samples": [s.__dict__ for s in day.samples],
        }
        print(
            f"  {summary.sent} requests, {summary.failed} failed; both targets (TTFT"
            f" {daychat.TTFT_S:g} s, TPOT {daychat.TPOT_S * 1000:g} ms) met by"
            f" {100 * (summary.attainment or 0):.1f}% ({100 * day.settled_attainment():.1f}% once"
            f" each part of the day settled); KV cache: {kv.get('reserved', 'waiting')} reserved"
            f" in {HOME}'s pool, {kv.get('quotaPerNode', '-')} on each node"
        )

    def fault_node_down(self) -> None:
        job = "finetune-elastic"
        with self.step(f"node failure under a rank of {job} (node-down)") as tick:
            self.wait(lambda: self.checkpointed(job), f"{job}'s first memory checkpoint", tick)
            victim = self.node_of(job, rank=1)
            before = len(self.job(job)["status"].get("recoveries") or [])
            self.matrixpool("cluster", "fault", "node-down", victim)
            injected = clock.SYSTEM.monotonic()
            entry = self.wait(lambda: self.recovered(job, before), f"{job} recovered", tick)
            took = clock.SYSTEM.monotonic() - injected
            self.matrixpool("cluster", "fault", "node-up", victim)
        self.faults.append({"fault": f"node-down {victim}", "job": job, "seconds": round(took, 2)})
        _print_recovery(entry, took)

    def fault_bad_card(self) -> None:
        job = "finetune-elastic"
        with self.step(f"a bad card under a rank of {job} (cards NODE 3)") as tick:
            self.wait(lambda: self.checkpointed(job), f"{job} training again", tick)
            sick = self.node_of(job, rank=0)
            before = len(self.job(job)["status"].get("recoveries") or [])
            self.matrixpool("cluster", "fault", "cards", sick, "3")
            injected = clock.SYSTEM.monotonic()
            entry = self.wait(lambda: self.recovered(job, before), f"{job} recovered", tick)
            took = clock.SYSTEM.monotonic() - injected
            self.matrixpool("cluster", "fault", "cards", sick, "")
        self.faults.append({"fault": f"cards {sick} 3", "job": job, "seconds": round(took, 2)})
        _print_recovery(entry, took)

    def wait_transition(self, window: str, tick: Ticker, after: str = "") -> dict[str, Any]:
        assert self.observer is not None
        observer = self.observer

        def settled() -> dict[str, Any] | None:
            for move in observer.settled():
                if move.get("window") == window and move["startedAt"] > after:
                    return move
            return None

        return self.wait(settled, f"the {window} split in place", tick)

    def narrate_transition(self, move: dict[str, Any]) -> None:
        print(
            f"  {move['window']}: inference {move.get('inferenceCards')} cards, training "
            f"{move.get('trainingCards')} cards, in place {move.get('seconds')} s after the "
            f"boundary (checkpoint {move.get('checkpointSeconds') or 0} s, eviction "
            f"{move.get('evictionSeconds') or 0} s, "
            f"placement {move.get('placementSeconds') or 0} s)"
        )

    def snapshot(self, phase: str) -> None:
        rows = self.job_rows()
        self.snapshots.append({"phase": phase, "workloads": [_row_json(r) for r in rows]})
        print(f"  placements ({phase}): " + ", ".join(f"{r.name} {r.cards}" for r in rows))

    # ---- the summary -----------------------------------------------------------------------------

    def summarize(self) -> None:
        assert self.observer is not None
        transitions = self.observer.settled()
        recoveries = []
        for item in self.training_jobs():
            name = item["metadata"]["name"]
            for entry in (item.get("status") or {}).get("recoveries") or []:
                recoveries.append({"job": name, **entry})
        rows = self.job_rows()
        total = clock.SYSTEM.monotonic() - self.started
        self.summary = {
            "plan": self.plan.name,
            "namespace": DEMO_NAMESPACE,
            "seconds": round(total, 1),
            "steps": self.steps,
            "placements": [_row_json(r) for r in rows],
            "phases": self.snapshots,
            "transitions": transitions,
            "recoveries": recoveries,
            "faults": self.faults,
            "serving": self.serving,
            "kubeconfig": str(self.local.kubeconfig),
            "metrics": f"http://127.0.0.1:{self.metrics_port}/metrics",
            "simFolder": str(self.folder / "sim"),
        }
        print("\n==> summary", flush=True)
        print("placements")
        print(render.jobs_table(rows))
        print("\ntransitions (SuperNode status.transition, as observed)")
        print(transitions_table(transitions))
        print("\nrecoveries (TrainingJob status.recoveries)")
        print(recoveries_table(recoveries))
        print("\nsteps")
        print(render.table(("STEP", "SECONDS"), ((s["step"], s["seconds"]) for s in self.steps)))
        print(f"\ndemo finished in {total:.1f} s", flush=True)

    # ---- holding and stopping ------------------------------------------------------------------

    def hold(self) -> None:
        print(f"everything keeps running; export KUBECONFIG={self.local.kubeconfig}")
        print("press Ctrl-C to stop it", flush=True)
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        while not stop.wait(1):
            if any(p.poll() is not None for p in self.processes.values()):
                print("a demo process exited; stopping", flush=True)
                return

    def stop(self) -> None:
        if self.observer is not None:
            self.observer.halt.set()
        for name in ("sim",):
            process = self.processes.get(name)
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
        self.local.down()

    # ---- helpers ---------------------------------------------------------------------------------

    @contextmanager
    def step(self, text: str) -> Iterator[Ticker]:
        print(f"==> {text}", flush=True)
        begun = clock.SYSTEM.monotonic()
        ticker = Ticker(text)
        try:
            yield ticker
        finally:
            ticker.clear()
        seconds = round(clock.SYSTEM.monotonic() - begun, 1)
        self.steps.append({"step": text, "seconds": seconds})
        print(f"    done in {seconds:.1f} s", flush=True)

    def wait(self, probe: Callable[[], T | None], what: str, tick: Ticker) -> T:
        deadline = clock.SYSTEM.monotonic() + self.plan.deadline
        while True:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise DemoError(f"{name} exited ({process.returncode}); see {self.log(name)}")
            found = probe()
            if found:
                return found
            if clock.SYSTEM.monotonic() > deadline:
                raise DemoError(
                    f"{what}: not reached in {self.plan.deadline:.0f} s; logs in {self.folder}"
                )
            tick.show(what)
            time.sleep(0.5)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "ab") as out:
            process = subprocess.Popen(
                argv,
                env={**os.environ, "KUBECONFIG": str(self.local.kubeconfig), **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=cluster._die_with_parent,
            )
        print(f"  {name} pid {process.pid}, log {self.log(name)}", flush=True)
        return process

    def log(self, name: str) -> Path:
        return self.folder / f"{name}.log"

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return cluster.kubectl(self.local, *args, input=input, check=check)

    def matrixpool(self, *args: str) -> str:
        env = {**os.environ, "MATRIXPOOL_CLUSTER_DIR": str(self.local.folder)}
        argv = [sys.executable, "-m", "matrixpool.cli", *args]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if result.returncode:
            raise DemoError(f"matrixpool {' '.join(args)} failed: {result.stderr.strip()}")
        print(f"  $ matrixpool {' '.join(args)}", flush=True)
        return result.stdout

    def plugin(self, *args: str) -> str:
        env = {**os.environ, "KUBECONFIG": str(self.local.kubeconfig)}
        argv = [sys.executable, "-m", "matrixpool.cli", *args]
        return subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout

    def get(self, *args: str) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.kubectl("get", *args, "-o", "json").stdout)
        return body

    def job(self, name: str) -> dict[str, Any]:
        return self.get("trainingjob", name, "-n", DEMO_NAMESPACE)

    def training_jobs(self) -> list[dict[str, Any]]:
        return list(self.get("trainingjobs", "-n", DEMO_NAMESPACE)["items"])

    def gang_pods(self) -> list[dict[str, Any]]:
        return list(self.get("pods", "-n", DEMO_NAMESPACE, "-l", "matrixpool.dev/job")["items"])

    def job_rows(self) -> list[report.JobRow]:
        inference = self.get("inferenceservices", "-n", DEMO_NAMESPACE)["items"]
        return report.job_rows(self.training_jobs(), inference, self.gang_pods())

    def placed(self, body: dict[str, Any]) -> bool:
        """The workload is bound, or waits with a reason (a suspended or too-big job)."""
        current = self.get(body["kind"].lower(), body["metadata"]["name"], "-n", DEMO_NAMESPACE)
        status = current.get("status") or {}
        if body["kind"] == "TrainingJob" and status.get("phase") in ("Running", "Suspended"):
            return True
        kind = "Scheduled" if body["kind"] == "TrainingJob" else "Ready"
        conditions = status.get("conditions") or []
        condition: dict[str, Any] = next((c for c in conditions if c.get("type") == kind), {})
        return condition.get("status") == "True"

    def running(self, name: str) -> bool:
        status = self.job(name).get("status") or {}
        replicas = status.get("replicas") or {}
        return status.get("phase") == "Running" and replicas.get("running", 0) > 0

    def night_job_ran(self, night: dict[str, Any]) -> bool:
        """nightly-distill runs, or the night is already over (a slow machine)."""
        assert self.observer is not None
        later = [m for m in self.observer.settled() if m["startedAt"] > night["startedAt"]]
        return self.running("nightly-distill") or bool(later)

    def checkpointed(self, name: str) -> bool:
        status = self.job(name).get("status") or {}
        memory = (status.get("checkpoints") or {}).get("memory")
        return self.running(name) and not status.get("recovering") and isinstance(memory, int)

    def recovered(self, name: str, before: int) -> dict[str, Any] | None:
        status = self.job(name).get("status") or {}
        entries = status.get("recoveries") or []
        done = len(entries) > before and not status.get("recovering")
        return dict(entries[-1]) if done and status.get("phase") == "Running" else None

    def node_of(self, job: str, rank: int) -> str:
        for pod in self.gang_pods():
            labels = pod["metadata"]["labels"]
            if labels.get("matrixpool.dev/job") == job and labels.get("matrixpool.dev/rank") == str(
                rank
            ):
                node = pod["spec"].get("nodeName")
                if node and not pod["metadata"].get("deletionTimestamp"):
                    return str(node)
        raise DemoError(f"rank {rank} of {job} is not bound")


class TransitionObserver(threading.Thread):
    """Polls SuperNode ``status.transition`` of sn-0 and keeps every distinct transition (by
    ``startedAt``), the newest version of each."""

    def __init__(self, local: cluster.Cluster, period: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.local = local
        self.period = period
        self.halt = threading.Event()
        self.lock = threading.Lock()
        self.seen: dict[str, dict[str, Any]] = {}

    def run(self) -> None:
        while not self.halt.wait(self.period):
            try:
                self.poll()
            except Exception:  # the API busy for a moment: poll again
                continue

    def poll(self) -> None:
        result = cluster.kubectl(self.local, "get", "supernode", SHARED, "-o", "json", check=False)
        if result.returncode:
            return
        move = (json.loads(result.stdout).get("status") or {}).get("transition")
        if move and move.get("startedAt"):
            with self.lock:
                self.seen[move["startedAt"]] = {"supernode": SHARED, **move}

    def settled(self) -> list[dict[str, Any]]:
        """Settled transitions, oldest first."""
        self.poll()
        with self.lock:
            moves = [dict(m) for m in self.seen.values() if m.get("settledAt")]
        return sorted(moves, key=lambda m: str(m["startedAt"]))


class Ticker:
    """The progress line of a long step: on a terminal an updating line with the seconds spent
    and what is awaited; elsewhere (logs, CI) a line every 15 s."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.begun = clock.SYSTEM.monotonic()
        self.tty = sys.stdout.isatty()
        self.last = self.begun
        self.drawn = False

    def show(self, what: str) -> None:
        spent = clock.SYSTEM.monotonic() - self.begun
        if self.tty:
            print(f"\r    … {spent:5.1f} s  waiting for {what}\x1b[K", end="", flush=True)
            self.drawn = True
        elif clock.SYSTEM.monotonic() - self.last >= 15:
            self.last = clock.SYSTEM.monotonic()
            print(f"    … {spent:.0f} s, waiting for {what}", flush=True)

    def clear(self) -> None:
        if self.drawn:
            print("\r\x1b[K", end="", flush=True)


# ---- tables ------------------------------------------------------------------------------------


def transitions_table(moves: list[dict[str, Any]]) -> str:
    if not moves:
        return "(none)"
    headers = ("SUPERNODE", "WINDOW", "STARTED", "INFERENCE", "TRAINING", "SECONDS")
    return render.table(
        (*headers, "CHECKPOINT", "EVICTION", "PLACEMENT"),
        (
            (
                *(m["supernode"], m.get("window"), m["startedAt"], m.get("inferenceCards")),
                *(m.get("trainingCards"), m.get("seconds"), m.get("checkpointSeconds")),
                *(m.get("evictionSeconds"), m.get("placementSeconds")),
            )
            for m in moves
        ),
    )


def recoveries_table(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "(none)"
    return render.table(
        ("JOB", "ID", "LEVEL", "CAUSE", "RANKS", "RESTORED-STEP", "LOST-STEPS", "SECONDS"),
        (
            (
                *(e["job"], e.get("id"), e["level"], e["cause"]),
                *(",".join(str(r) for r in e.get("ranks") or []), e.get("restoredStep")),
                *(e.get("lostSteps"), _recovery_seconds(e)),
            )
            for e in entries
        ),
    )


def _recovery_seconds(entry: dict[str, Any]) -> str | None:
    if not entry.get("recoveredAt"):
        return None
    detected = dt.datetime.fromisoformat(str(entry["detectedAt"]).replace("Z", "+00:00"))
    recovered = dt.datetime.fromisoformat(str(entry["recoveredAt"]).replace("Z", "+00:00"))
    return f"{(recovered - detected).total_seconds():.1f}"


def _print_recovery(entry: dict[str, Any], took: float) -> None:
    moves = ", ".join(f"{a} → {b}" for a, b in (entry.get("moves") or {}).items())
    print(
        f"  {entry['level']}: {entry['cause']}; ranks {entry.get('ranks')} "
        f"{'(' + moves + ') ' if moves else ''}restored step {entry.get('restoredStep')}, "
        f"lost {entry.get('lostSteps')} steps; fault to recorded recovery {took:.1f} s",
        flush=True,
    )


def _row_json(row: report.JobRow) -> dict[str, Any]:
    return {
        "kind": row.kind,
        "name": row.name,
        "phase": row.phase,
        "supernodes": row.supernodes,
        "cards": row.cards,
        "desired": row.desired,
        "bound": row.bound,
        "running": row.running,
    }


def _shape(body: dict[str, Any]) -> str:
    spec = body["spec"]
    if body["kind"] == "SuperNode":
        sharing = "time-shared" if spec.get("timeSharing") else "training only"
        return f"{spec['cardsPerNode']} cards per node, {sharing}"
    if body["kind"] == "InferenceService":
        roles = spec["roles"]
        return ", ".join(
            f"{r['name']} {r['replicas']}×{r.get('podsPerReplica', 1)} pods×{r['cardsPerPod']}"
            for r in roles
        )
    where = spec.get("superNode") or "any supernode"
    return f"{spec['replicas']} ranks × {spec['cardsPerReplica']} cards, {where}"


def _describe(plan: Plan) -> str:
    return (
        f"clock {plan.clock_speed:g}× fast (a night lasts {plan.night_seconds:.0f} s), "
        f"a training step every {plan.step_seconds:g} s"
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=2, default=str))
    temporary.replace(path)


def _say(line: str) -> None:
    print(line, flush=True)
