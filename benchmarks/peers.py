"""Side by side on one cluster: matrixpool, kube-scheduler's own gang + topology scheduling, and
Kueue with Topology Aware Scheduling — one trace, three schedulers, one run.

    sudo .venv/bin/python benchmarks/peers.py --json          # or: make peers

Starts a local control plane with the peers (``matrixpool cluster up --peers``: feature gates
GenericWorkload and TopologyAwareWorkloadScheduling, Kueue v0.17 as a process) on ``--supernodes``
supernodes of 48 kwok nodes × 8 cards, racks of 4 nodes. Each system then runs, in turn, on the
same nodes and the same seeded trace, each gang written in that system's own API:

- matrixpool: a TrainingJob (``superNodeAffinity: Required``; ``groupSize`` = its pods when it
  fits a rack, else ``localityWaitSeconds`` = ``--locality-wait``, 10 s by default) or, for an
  inference group, an InferenceService role of ``podsPerReplica`` pods;
- kube-scheduler: a PodGroup (``gang.minCount`` = the gang's pods,
  ``schedulingConstraints.topology`` on the rack label when the gang fits a rack, else on the
  supernode label) and its pods, created by this script as a workload controller would (32 at a
  time);
- Kueue: a batch/v1 Job (parallelism = completions = pods) with
  ``kueue.x-k8s.io/podset-required-topology`` on the same label; the Job controller creates pods.

Phases per system: (1) a burst that fills the empty cluster with 8-node gangs at once — pods
bound per second; (2) the trace: gangs arrive over ``--seconds`` (Poisson), each is deleted
``duration`` seconds after its last pod was bound — per-gang seconds from creation to every pod
bound (p50/p99), makespan, card-hours left idle while a gang waited, gangs placed across more
racks or supernodes than they need, and locality per training gang from where its pods landed by
rank (``extra_racks``: racks used minus the fewest that hold it, summed; ``ring_hops``: neighbouring
ranks, around the ring, on different racks, summed, beside ``ring_hops_min``, the fewest its
fewest racks allow), gangs left partly bound; (3) preemption: a high-priority
gang into a cluster full of low-priority gangs — seconds to bind, pods evicted, whether it waited
for a checkpoint. Durations are seconds, not hours: the figures compare schedulers, not jobs.
Not in the default phases: (4) ``single``: gangs of 1, 2 and 4 whole nodes submitted one at a
time into an otherwise idle cluster — per-gang seconds from creation to every pod bound by size,
the path's own latency without queueing. The burst also reports the CPU seconds each process
of the machine spent while it ran (``/proc``), which says where a pod's cost goes.

Prints progress on stderr and, as its last line, one JSON object (``systems``: one entry per
system with the figures, or ``error`` with the reason it could not run), and writes a PNG of
card utilisation over time per system (``--png``) and, with ``--dump PATH``, where each gang of
the trace went per system (racks used beside the fewest, node per rank, when it was created,
bound, deleted and gone). docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

from matrixpool.api import labels
from matrixpool.devcluster import binaries, cluster, kueue, topology
from matrixpool.k8s import client as k8s_client

NAMESPACE = "peers"
GANG_LABEL = "bench.matrixpool.dev/gang"
RANK_LABEL = "bench.matrixpool.dev/rank"  # kube-scheduler's pods (this script makes them)
JOB_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # Kueue's Indexed Job pods
RUN_FOREVER = {"pod-complete.stage.kwok.x-k8s.io/delay": "24h"}  # kwok completes Job pods
CONCURRENCY = 32
PHASES = frozenset({"burst", "trace", "preemption"})  # "single" on request
# matrixpool's TrainingJobs larger than a rack ask to wait this long for the fewest racks
# (spec.placement.localityWaitSeconds; a user's choice, as the peers' topology annotations are).
# 6 s: over the traces of 30 seeds (benchmarks/locality_wait.py --seeds 30), the wait that cost
# the least idle time (1.05x no wait's, mean) for a third of its extra racks (3.9 against 11.1)
LOCALITY_WAIT_SECONDS = 6
PARTIAL_SECONDS = 10.0  # some pods bound, others not, this long: a gang left partly bound
IMAGE = "peers/worker:1"  # kwok runs no image


@dataclass(frozen=True)
class Gang:
    """One gang of the trace, in no system's API."""

    name: str
    arrival: float  # seconds after the trace starts
    pods: int
    cards: int  # per pod
    duration: float  # seconds from every pod bound to its deletion
    serving: bool = False  # an inference group (matrixpool: an InferenceService)
    priority: str = "low"
    within: str | None = None  # the label it must stay inside; None: the smallest level it fits

    def nodes_needed(self, cards_per_node: int) -> int:
        return math.ceil(self.pods * self.cards / cards_per_node)

    def domain(self, shape: topology.Shape) -> str:
        """The topology level it must stay inside: a rack when it fits one, else a supernode."""
        if self.within:
            return self.within
        fits_rack = self.nodes_needed(shape.cards_per_node) <= shape.nodes_per_rack
        return labels.RACK if fits_rack else labels.SUPERNODE


def make_trace(seed: int, count: int, seconds: float) -> list[Gang]:
    """The stated distribution: 55 % small training gangs of 1–4 nodes, 20 % of 8 nodes, 10 %
    large gangs of 16–48 nodes, 15 % inference groups of 2–6 pods × 4 cards; durations
    log-uniform 8–60 s (large gangs 20–60 s); Poisson arrivals over ``seconds``."""
    rng = random.Random(seed)
    gangs = []
    at = 0.0
    for index in range(count):
        at += rng.expovariate(count / seconds)
        draw = rng.random()
        serving = False
        cards = 8
        if draw < 0.55:
            pods = rng.choice([1, 2, 2, 4, 4])
        elif draw < 0.75:
            pods = 8
        elif draw < 0.85:
            pods = rng.choice([16, 24, 32, 48])
        else:
            pods, cards, serving = rng.randint(2, 6), 4, True
        low = 20.0 if pods >= 16 else 8.0
        duration = math.exp(rng.uniform(math.log(low), math.log(60.0)))
        gangs.append(Gang(f"g{index:03d}", round(at, 3), pods, cards, round(duration, 2), serving))
    return gangs


# ---- the three systems ---------------------------------------------------------------------


class System:
    """How one scheduler is given a gang, and how the gang is removed."""

    name = ""

    def __init__(self, api: k8s_client.Api, shape: topology.Shape) -> None:
        self.api = api
        self.shape = shape
        self.card = shape.card_resource

    def setup(self) -> None:
        return None

    def submit(self, gang: Gang) -> None:
        raise NotImplementedError

    def remove(self, gang: Gang) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        return None

    def checkpoints(self) -> dict[str, int] | None:
        """How the preempted gangs' checkpoints went, by outcome; None: not expressible."""
        return None

    def container(self, gang: Gang) -> dict[str, Any]:
        cards = {self.card: str(gang.cards)}
        return {"name": "w", "image": IMAGE, "resources": {"requests": cards, "limits": cards}}


class Matrixpool(System):
    name = "matrixpool"

    def __init__(
        self, api: k8s_client.Api, shape: topology.Shape, kubeconfig: Path, locality_wait: int = 0
    ) -> None:
        super().__init__(api, shape)
        self.kubeconfig = kubeconfig
        self.locality_wait = locality_wait
        self.operator: subprocess.Popen[bytes] | None = None
        self.log = kubeconfig.parent / "operator.log"

    def setup(self) -> None:
        for sn in range(self.shape.supernodes):
            name = f"sn-{sn}"
            body = {
                "apiVersion": "matrixpool.dev/v1alpha1",
                "kind": "SuperNode",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"matchLabels": {labels.SUPERNODE: name}},
                    "cardResource": self.card,
                    "cardsPerNode": self.shape.cards_per_node,
                    "topologyKeys": [labels.RACK],
                    "spares": {"nodes": 0},
                },
            }
            self.api.custom.create_cluster_custom_object(
                "matrixpool.dev", "v1alpha1", "supernodes", body
            )
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "MATRIXPOOL_LOG_FORMAT": "json",
        }
        with open(self.log, "ab") as log:
            self.operator = subprocess.Popen(
                [sys.executable, "-m", "matrixpool.cli", "run"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self.reported, 120, "the SuperNodes' card counts")

    def reported(self) -> bool:
        for sn in range(self.shape.supernodes):
            body = self.api.custom.get_cluster_custom_object(
                "matrixpool.dev", "v1alpha1", "supernodes", f"sn-{sn}"
            )
            if not ((body.get("status") or {}).get("cards") or {}).get("total"):
                return False
        return True

    def submit(self, gang: Gang) -> None:
        template = {"spec": {"containers": [{"name": "w", "image": IMAGE}]}}
        priority = 1000 if gang.priority == "high" else 100
        if gang.serving:
            plural, kind = "inferenceservices", "InferenceService"
            spec: dict[str, Any] = {
                "priority": priority,
                "roles": [
                    {
                        "name": "serve",
                        "replicas": 1,
                        "podsPerReplica": gang.pods,
                        "cardsPerPod": gang.cards,
                        "template": template,
                    }
                ],
            }
        else:
            plural, kind = "trainingjobs", "TrainingJob"
            spec = {
                "replicas": gang.pods,
                "cardsPerReplica": gang.cards,
                "priority": priority,
                "placement": self.placement(gang),
                "checkpoint": {"graceSeconds": 5},
                "template": template,
            }
        body = {
            "apiVersion": "matrixpool.dev/v1alpha1",
            "kind": kind,
            "metadata": {"name": gang.name, "namespace": NAMESPACE},
            "spec": spec,
        }
        self.api.custom.create_namespaced_custom_object(
            "matrixpool.dev", "v1alpha1", NAMESPACE, plural, body
        )

    def checkpoints(self) -> dict[str, int] | None:
        """``status.preemptions[].checkpoint`` of every TrainingJob: Answered, GraceExpired
        or NotAsked (a job with no checkpoint tier is evicted at once)."""
        jobs = self.api.custom.list_namespaced_custom_object(
            "matrixpool.dev", "v1alpha1", NAMESPACE, "trainingjobs"
        )["items"]
        outcomes: dict[str, int] = {}
        for body in jobs:
            for record in (body.get("status") or {}).get("preemptions") or []:
                outcome = str(record.get("checkpoint"))
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
        return outcomes

    def placement(self, gang: Gang) -> dict[str, Any]:
        """One supernode always; a gang that fits a rack keeps its ranks in one
        (``groupSize``: matrixpool's way of saying what the peers' rack constraint says); a
        larger one waits up to ``--locality-wait`` seconds for the fewest racks."""
        placement: dict[str, Any] = {"superNodeAffinity": "Required"}
        if gang.domain(self.shape) == labels.RACK and gang.pods > 1:
            placement["groupSize"] = gang.pods
        elif self.locality_wait > 0:
            placement["localityWaitSeconds"] = self.locality_wait
        return placement

    def remove(self, gang: Gang) -> None:
        plural = "inferenceservices" if gang.serving else "trainingjobs"
        ignore_missing(
            lambda: self.api.custom.delete_namespaced_custom_object(
                "matrixpool.dev", "v1alpha1", NAMESPACE, plural, gang.name
            )
        )

    def teardown(self) -> None:
        if self.operator is not None:
            self.operator.terminate()
            self.operator.wait(timeout=30)
        keep = os.environ.get("PEERS_OPERATOR_LOG")  # where to keep the operator's log
        if keep:
            Path(keep).write_bytes(self.log.read_bytes())


class KubeScheduler(System):
    name = "kube-scheduler"

    def __init__(self, api: k8s_client.Api, shape: topology.Shape) -> None:
        super().__init__(api, shape)
        self.pool = ThreadPoolExecutor(max_workers=CONCURRENCY)

    def submit(self, gang: Gang) -> None:
        group = {
            "apiVersion": "scheduling.k8s.io/v1beta1",
            "kind": "PodGroup",
            "metadata": {"name": gang.name, "namespace": NAMESPACE},
            "spec": {
                "schedulingPolicy": {"gang": {"minCount": gang.pods}},
                "schedulingConstraints": {"topology": [{"key": gang.domain(self.shape)}]},
                "disruptionMode": {"all": {}},
                "priorityClassName": f"peers-{gang.priority}",
            },
        }
        self.api.custom.create_namespaced_custom_object(
            "scheduling.k8s.io", "v1beta1", NAMESPACE, "podgroups", group
        )

        def create(rank: int) -> None:
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{gang.name}-{rank}",
                    "labels": {GANG_LABEL: gang.name, RANK_LABEL: str(rank)},
                },
                "spec": {
                    "schedulingGroup": {"podGroupName": gang.name},
                    "priorityClassName": f"peers-{gang.priority}",
                    "containers": [self.container(gang)],
                },
            }
            self.api.core.create_namespaced_pod(NAMESPACE, pod, _preload_content=False)

        list(self.pool.map(create, range(gang.pods)))

    def remove(self, gang: Gang) -> None:
        ignore_missing(
            lambda: self.api.core.delete_collection_namespaced_pod(
                NAMESPACE, label_selector=f"{GANG_LABEL}={gang.name}", grace_period_seconds=0
            )
        )
        ignore_missing(
            lambda: self.api.custom.delete_namespaced_custom_object(
                "scheduling.k8s.io", "v1beta1", NAMESPACE, "podgroups", gang.name
            )
        )

    def teardown(self) -> None:
        self.pool.shutdown()


class Kueue(System):
    name = "kueue"

    def setup(self) -> None:
        self.api.custom.create_namespaced_custom_object(
            "kueue.x-k8s.io",
            "v1beta2",
            NAMESPACE,
            "localqueues",
            kueue.local_queue(NAMESPACE),
        )

    def submit(self, gang: Gang) -> None:
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": gang.name,
                "labels": {
                    kueue.QUEUE_LABEL: kueue.CLUSTER_QUEUE,
                    kueue.PRIORITY_LABEL: f"bench-{gang.priority}",
                },
            },
            "spec": {
                "parallelism": gang.pods,
                "completions": gang.pods,
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "template": {
                    "metadata": {
                        "labels": {GANG_LABEL: gang.name},
                        "annotations": {
                            kueue.REQUIRED_TOPOLOGY: gang.domain(self.shape),
                            **RUN_FOREVER,
                        },
                    },
                    "spec": {"restartPolicy": "Never", "containers": [self.container(gang)]},
                },
            },
        }
        batch(self.api).create_namespaced_job(NAMESPACE, job, _preload_content=False)

    def remove(self, gang: Gang) -> None:
        ignore_missing(
            lambda: batch(self.api).delete_namespaced_job(
                gang.name, NAMESPACE, propagation_policy="Background", grace_period_seconds=0
            )
        )


# ---- recording -------------------------------------------------------------------------------


@dataclass
class PodRecord:
    gang: str
    cards: int
    rank: int | None = None  # the pod's rank: matrixpool's label, ours, or the Job's index
    node: str = ""
    bound: float | None = None
    gone: float | None = None


@dataclass
class Recorder:
    """Every pod of the namespace from a raw watch: when it was bound, where, when it was gone."""

    api: k8s_client.Api
    card: str
    origin: float = field(default_factory=time.monotonic)
    pods: dict[str, PodRecord] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self.run, daemon=True).start()

    def now(self) -> float:
        return time.monotonic() - self.origin

    def run(self) -> None:
        version = ""
        while not self.stop.is_set():
            try:
                if not version:
                    listed = json.loads(
                        self.api.core.list_namespaced_pod(NAMESPACE, _preload_content=False).data
                    )
                    for item in listed["items"]:
                        self.saw("ADDED", item)
                    version = listed["metadata"]["resourceVersion"]
                response = self.api.core.list_namespaced_pod(
                    NAMESPACE,
                    watch=True,
                    resource_version=version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    _preload_content=False,
                )
                for line in response:
                    if self.stop.is_set():
                        break
                    event = json.loads(line)
                    if event["type"] == "ERROR":
                        version = ""
                        break
                    version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self.saw(event["type"], event["object"])
            except Exception as error:  # a dropped watch: list again
                print(f"  watch restarted: {error}", file=sys.stderr)
                version = ""
                time.sleep(0.2)

    def saw(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        pod_labels = pod["metadata"].get("labels") or {}
        gang = pod_labels.get(GANG_LABEL) or pod_labels.get(labels.JOB)
        if not gang:
            return
        at = self.now()
        with self.lock:
            record = self.pods.get(uid)
            if record is None:
                requests = (pod["spec"]["containers"][0].get("resources") or {}).get(
                    "requests"
                ) or {}
                rank = next(
                    (
                        pod_labels[k]
                        for k in (labels.RANK, RANK_LABEL, JOB_INDEX_LABEL)
                        if k in pod_labels
                    ),
                    None,
                )
                record = self.pods[uid] = PodRecord(
                    gang, int(requests.get(self.card, 0)), int(rank) if rank is not None else None
                )
            node = pod["spec"].get("nodeName")
            if node and record.bound is None:
                record.bound, record.node = at, node
            if kind == "DELETED" and record.gone is None:
                record.gone = at

    def live(self, gang: str) -> list[PodRecord]:
        with self.lock:
            return [p for p in self.pods.values() if p.gang == gang and p.gone is None]

    def count_live(self) -> int:
        with self.lock:
            return sum(1 for p in self.pods.values() if p.gone is None)


# ---- one system through the phases ---------------------------------------------------------


@dataclass
class GangRun:
    gang: Gang
    created: float = 0.0
    bound: float | None = None
    removed: float | None = None
    partial_since: float | None = None
    partial: bool = False
    nodes: set[str] = field(default_factory=set)
    ranks: dict[int, str] = field(default_factory=dict)  # rank → node, once bound whole


def run_system(
    system: System,
    api: k8s_client.Api,
    shape: topology.Shape,
    trace: list[Gang],
    say: Any,
    phases: set[str] = PHASES,
) -> dict[str, Any]:
    recorder = Recorder(api, shape.card_resource)
    recorder.start()
    try:
        system.setup()
        figures: dict[str, Any] = {}
        if "burst" in phases:
            say(f"[{system.name}] burst")
            burst = run_burst(system, recorder, shape)
            say(f"[{system.name}] burst: {burst['pods']} pods in {burst['seconds']} s")
            figures["pods_per_second"] = burst["pods_per_second"]
            figures["burst"] = burst
        if "trace" in phases:
            say(f"[{system.name}] trace of {len(trace)} gangs")
            figures |= run_trace(system, recorder, shape, trace, say)
        if "preemption" in phases:
            say(f"[{system.name}] preemption")
            figures["preemption"] = run_preemption(system, recorder, shape)
        if "single" in phases:
            say(f"[{system.name}] single gangs")
            figures["single"] = run_single(system, recorder, shape)
        return figures
    finally:
        recorder.stop.set()
        system.teardown()


def run_burst(system: System, recorder: Recorder, shape: topology.Shape) -> dict[str, Any]:
    """Fill the empty cluster with 8-node gangs submitted at once."""
    per_gang = 8
    count = shape.node_count // per_gang
    gangs = [Gang(f"burst{i:02d}", 0.0, per_gang, shape.cards_per_node, 0.0) for i in range(count)]
    runs = {g.name: GangRun(g) for g in gangs}
    before = cpu_seconds()
    started = recorder.now()
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(system.submit, gangs))
    total = count * per_gang

    def all_bound() -> bool:
        with recorder.lock:
            bound = [p.bound for p in recorder.pods.values() if p.gang in runs and p.bound]
        return len(bound) >= total

    wait_for(all_bound, 600, "the burst's pods bound")
    after = cpu_seconds()
    with recorder.lock:
        last = max(p.bound or 0 for p in recorder.pods.values() if p.gang in runs)
    seconds = last - started
    spent = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
    for gang in gangs:
        system.remove(gang)
    wait_for(lambda: recorder.count_live() == 0, 300, "the burst's pods gone")
    return {
        "pods": total,
        "seconds": round(seconds, 3),
        "pods_per_second": round(total / seconds, 1),
        # CPU seconds per process from the first submission until every pod was bound
        "cpu_seconds": dict(sorted(((k, v) for k, v in spent.items() if v >= 0.05), key=_second)),
    }


def _second(item: tuple[str, float]) -> float:
    return -item[1]


def cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of every process, summed by :func:`program` (Python programs
    by their module or script: the operator, this benchmark)."""
    totals: dict[str, float] = {}
    for argv, seconds in processes().values():
        name = program(argv)
        totals[name] = totals.get(name, 0.0) + seconds
    return totals


def processes() -> dict[int, tuple[list[str], float]]:
    """Every process: its command line and its user + system CPU seconds (``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[list[str], float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if argv:
            found[int(entry)] = (argv, (int(fields[11]) + int(fields[12])) / tick)
    return found


def program(argv: list[str]) -> str:
    """What :func:`cpu_seconds` calls a process: its executable's name, or for Python the
    module it runs (``-m``) or its script's name."""
    name = os.path.basename(argv[0])
    if name.startswith("python") and len(argv) > 1:
        rest = argv[1:]
        name = rest[1] if rest[0] == "-m" and len(rest) > 1 else Path(rest[0]).name
        name = "matrixpool operator" if name == "matrixpool.cli" else name
    return name


def run_single(system: System, recorder: Recorder, shape: topology.Shape) -> dict[str, Any]:
    """Gangs of 1, 2 and 4 nodes, one at a time into an idle cluster, 10 of each size: the
    median seconds from creation to every pod bound, by size."""
    sizes, each = (1, 2, 4), 10
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for k in range(each * len(sizes)):
        pods = sizes[k % len(sizes)]
        gang = Gang(f"single{k:02d}", 0.0, pods, shape.cards_per_node, 0.0)
        created = recorder.now()
        system.submit(gang)
        wait_for(lambda g=gang, n=pods: bound_pods(recorder, {g.name}) >= n, 60, gang.name)
        with recorder.lock:
            last = max(p.bound or 0 for p in recorder.pods.values() if p.gang == gang.name)
        seconds[pods].append(last - created)
        time.sleep(0.3)
        system.remove(gang)
        wait_for(lambda g=gang: bound_pods(recorder, {g.name}) == 0, 60, f"{gang.name} gone")
        time.sleep(0.2)
    return {
        "gangs": each * len(sizes),
        "p50_s_by_pods": {str(n): round(statistics.median(v), 4) for n, v in seconds.items()},
    }


def run_trace(
    system: System, recorder: Recorder, shape: topology.Shape, trace: list[Gang], say: Any
) -> dict[str, Any]:
    runs = {g.name: GangRun(g) for g in trace}
    removals: list[tuple[float, str]] = []
    start = recorder.now()
    samples: list[tuple[float, int, int]] = []  # (t, bound cards, gangs waiting)
    pending = sorted(trace, key=lambda g: g.arrival)
    submitter = ThreadPoolExecutor(max_workers=8)
    next_say = 0.0
    deadline = start + max(g.arrival for g in trace) + 900
    while True:
        now = recorder.now()
        while pending and start + pending[0].arrival <= now:
            gang = pending.pop(0)
            runs[gang.name].created = recorder.now()
            submitter.submit(system.submit, gang)
        with recorder.lock:
            by_gang: dict[str, list[PodRecord]] = {}
            for record in recorder.pods.values():
                if record.gone is None:
                    by_gang.setdefault(record.gang, []).append(record)
            bound_cards = sum(p.cards for ps in by_gang.values() for p in ps if p.bound)
        waiting = 0
        for name, run in runs.items():
            if not run.created or run.removed is not None:
                continue
            live = by_gang.get(name, [])
            bound = [p for p in live if p.bound is not None]
            if run.bound is None:
                waiting += 1
                if len(bound) >= run.gang.pods:
                    run.bound = max(p.bound or 0 for p in bound)
                    run.nodes = {p.node for p in bound}
                    run.ranks = {p.rank: p.node for p in bound if p.rank is not None}
                    heapq.heappush(removals, (run.bound + run.gang.duration, name))
                    run.partial_since = None
                elif bound:
                    run.partial_since = run.partial_since or now
                    if now - run.partial_since >= PARTIAL_SECONDS:
                        run.partial = True
                else:
                    run.partial_since = None
        samples.append((now - start, bound_cards, waiting))
        while removals and removals[0][0] <= now:
            _, name = heapq.heappop(removals)
            runs[name].removed = now
            submitter.submit(system.remove, runs[name].gang)
        if not pending and all(r.removed is not None for r in runs.values()):
            break
        if now > deadline:
            break
        if now >= next_say:
            done = sum(1 for r in runs.values() if r.bound is not None)
            say(f"  t={now - start:6.1f} s bound {done}/{len(runs)} cards {bound_cards}")
            next_say = now + 15
        time.sleep(0.05)
    submitter.shutdown(wait=True)
    wait_for(lambda: recorder.count_live() == 0, 300, "the trace's pods gone")
    end = recorder.now() - start
    with recorder.lock:
        gone: dict[str, list[float]] = {}
        for record in recorder.pods.values():
            if record.gone is not None and record.bound is not None:
                gone.setdefault(record.gang, []).append(record.gone)
    dump = placements(runs, shape, start, gone)
    return summarize(runs, samples, shape, end) | {"placements": dump}


def placements(
    runs: dict[str, GangRun],
    shape: topology.Shape,
    start: float,
    gone: dict[str, list[float]] | None = None,
) -> list[Any]:
    """Where each gang of the trace went, for ``--dump``: its size, the racks it used against
    the fewest that hold it, the node of each rank, and its seconds (after the trace started)
    of creation, of its last pod bound, of its deletion and of its first and last bound pod
    gone (``gone``: gang → when each such pod was gone, on the recorder's clock)."""
    found = []
    for run in sorted(runs.values(), key=lambda r: r.created):
        went = sorted((gone or {}).get(run.gang.name, []))
        nodes = run.gang.nodes_needed(shape.cards_per_node)
        racks = sorted({rack_of(n) for n in run.nodes})
        found.append(
            {
                "gang": run.gang.name,
                "pods": run.gang.pods,
                "cards": run.gang.cards,
                "serving": run.gang.serving,
                "nodes_needed": nodes,
                "fewest_racks": math.ceil(nodes / shape.nodes_per_rack),
                "racks": racks,
                "ranks": [run.ranks.get(k) for k in range(run.gang.pods)],
                "created_s": round(run.created - start, 3) if run.created else None,
                "bound_s": round(run.bound - start, 3) if run.bound is not None else None,
                "removed_s": round(run.removed - start, 3) if run.removed is not None else None,
                "gone_s": [round(went[0] - start, 3), round(went[-1] - start, 3)] if went else None,
            }
        )
    return found


def summarize(
    runs: dict[str, GangRun],
    samples: list[tuple[float, int, int]],
    shape: topology.Shape,
    end: float,
) -> dict[str, Any]:
    total_cards = shape.node_count * shape.cards_per_node
    latencies = sorted(r.bound - r.created for r in runs.values() if r.bound is not None)
    idle = 0.0
    for (t0, cards, waiting), (t1, _, _) in itertools.pairwise(samples):
        if waiting:
            idle += (total_cards - cards) * (t1 - t0)
    spread = spread_serving = 0
    extra_racks = hops = hops_min = unranked = 0
    for run in runs.values():
        if run.bound is None:
            continue
        racks = {rack_of(n) for n in run.nodes}
        supernodes = {r.rsplit("-rack-", 1)[0] for r in racks}
        nodes = run.gang.nodes_needed(shape.cards_per_node)
        fewest = math.ceil(nodes / shape.nodes_per_rack)
        if len(racks) > fewest or len(supernodes) > math.ceil(nodes / shape.nodes_per_supernode):
            spread += 1
            spread_serving += run.gang.serving
        if run.gang.serving:
            continue
        extra_racks += len(racks) - fewest
        if len(run.ranks) < run.gang.pods:
            unranked += 1
            continue
        hops += ring_hops([rack_of(run.ranks[k]) for k in range(run.gang.pods)])
        hops_min += fewest if fewest > 1 else 0
    never = sum(1 for r in runs.values() if r.bound is None)
    return {
        "gangs": len(runs),
        "gangs_bound": len(latencies),
        "gang_p50_s": round(percentile(latencies, 50), 3) if latencies else None,
        "gang_p99_s": round(percentile(latencies, 99), 3) if latencies else None,
        "makespan_s": round(end, 1),
        "idle_card_hours": round(idle / 3600, 3),
        "partial_gangs": sum(1 for r in runs.values() if r.partial),
        "never_bound": never,
        "spread_gangs": spread,
        # of which inference groups (matrixpool spreads an InferenceService's pods across racks
        # on purpose: DESIGN.md, placement rules)
        "spread_inference_groups": spread_serving,
        "extra_racks": extra_racks,
        "ring_hops": hops,
        "ring_hops_min": hops_min,
        "gangs_without_ranks": unranked,
        "utilisation": [(round(t, 2), c) for t, c, _ in samples[:: max(1, len(samples) // 600)]],
    }


def run_preemption(system: System, recorder: Recorder, shape: topology.Shape) -> dict[str, Any]:
    """Fill the cluster with low-priority 8-node gangs, then one high-priority 16-node gang."""
    count = shape.node_count // 8
    fill = [Gang(f"low{i:02d}", 0.0, 8, shape.cards_per_node, 0.0) for i in range(count)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(system.submit, fill))
    wait_for(lambda: bound_pods(recorder, {g.name for g in fill}) >= count * 8, 600, "filled")
    high = Gang("high", 0.0, 16, shape.cards_per_node, 0.0, priority="high")
    created = recorder.now()
    system.submit(high)
    try:
        wait_for(lambda: bound_pods(recorder, {"high"}) >= 16, 300, "the high gang bound")
        seconds: float | None = round(recorder.now() - created, 3)
    except TimeoutError:
        seconds = None
    with recorder.lock:
        evicted = [
            p
            for p in recorder.pods.values()
            if p.gang.startswith("low") and p.gone is not None and p.gone >= created
        ]
    checkpoints = system.checkpoints()
    for gang in [*fill, high]:
        system.remove(gang)
    wait_for(lambda: recorder.count_live() == 0, 300, "the preemption case's pods gone")
    return {
        "seconds_to_bind": seconds,
        "pods_evicted": len(evicted),
        "gangs_evicted": len({p.gang for p in evicted}),
        # by outcome, as the victims' status says; None: the system has no such step
        "checkpoints": checkpoints,
    }


def bound_pods(recorder: Recorder, gangs: set[str]) -> int:
    with recorder.lock:
        return sum(
            1 for p in recorder.pods.values() if p.gang in gangs and p.bound and p.gone is None
        )


def ring_hops(racks: list[str]) -> int:
    """Neighbouring ranks of a ring (the last next to the first) on different racks."""
    if len(racks) < 2:
        return 0
    return sum(1 for a, b in zip(racks, racks[1:] + racks[:1], strict=True) if a != b)


def rack_of(node: str) -> str:
    """sn-<i>-node-<j> → its rack name (topology.node's labels), from the node index."""
    return NODE_RACKS.get(node, node)


NODE_RACKS: dict[str, str] = {}


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def wait_for(probe: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout:.0f} s")
        time.sleep(0.1)


def batch(api: k8s_client.Api) -> Any:
    return kubernetes.client.BatchV1Api(api.client)


def ignore_missing(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception as error:
        if not k8s_client.is_status(error, 404):
            raise


# ---- main ------------------------------------------------------------------------------------


def prepare(api: k8s_client.Api, shape: topology.Shape) -> None:
    scheduling: Any = kubernetes.client.SchedulingV1Api(api.client)
    api.core.create_namespace({"metadata": {"name": NAMESPACE}})
    for name, value in (("peers-low", 100), ("peers-high", 1000)):
        scheduling.create_priority_class(
            {"metadata": {"name": name}, "value": value, "preemptionPolicy": "PreemptLowerPriority"}
        )
    for node in topology.nodes(shape):
        NODE_RACKS[node["metadata"]["name"]] = node["metadata"]["labels"][labels.RACK]


def clean(api: k8s_client.Api) -> None:
    """Nothing of one system may stay for the next."""
    for group, version, plural in (
        ("matrixpool.dev", "v1alpha1", "trainingjobs"),
        ("matrixpool.dev", "v1alpha1", "inferenceservices"),
        ("scheduling.k8s.io", "v1beta1", "podgroups"),
    ):
        try:
            api.custom.delete_collection_namespaced_custom_object(group, version, NAMESPACE, plural)
        except Exception as error:
            if not k8s_client.is_status(error, 404):
                raise
    batch(api).delete_collection_namespaced_job(NAMESPACE, propagation_policy="Background")
    api.core.delete_collection_namespaced_pod(NAMESPACE, grace_period_seconds=0)


def write_png(path: Path, results: dict[str, Any], total_cards: int) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (make peers installs it)"
    figure, axis = plt.subplots(figsize=(10, 4.5))
    for name, figures in results.items():
        series = figures.get("utilisation") or []
        if series:
            axis.plot(
                [t for t, _ in series], [100 * c / total_cards for _, c in series], label=name
            )
    axis.set_xlabel("seconds since the trace's first arrival")
    axis.set_ylabel("cards bound (%)")
    axis.set_ylim(0, 105)
    axis.legend()
    axis.set_title("card utilisation, same trace, same cluster")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--supernodes", type=int, default=4)
    parser.add_argument("--gangs", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=120.0, help="arrivals spread over")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--png", type=Path, default=Path("peers.png"))
    parser.add_argument(
        "--systems", default="matrixpool,kube-scheduler,kueue", help="comma-separated"
    )
    parser.add_argument(
        "--phases", default="burst,trace,preemption", help="comma-separated subset to run"
    )
    parser.add_argument(
        "--dump", type=Path, help="write each system's per-gang placements of the trace (JSON)"
    )
    parser.add_argument(
        "--locality-wait",
        type=int,
        default=LOCALITY_WAIT_SECONDS,
        help="matrixpool's spec.placement.localityWaitSeconds for gangs larger than a rack",
    )
    args = parser.parse_args()
    say: Any = (lambda _: None) if args.json else (lambda line: print(line, file=sys.stderr))
    if args.json:
        say = lambda line: print(line, file=sys.stderr)  # noqa: E731 - progress stays on stderr
    shape = topology.Shape(supernodes=args.supernodes)
    trace = make_trace(args.seed, args.gangs, args.seconds)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mp-peers-") as folder:
        local = cluster.Cluster(Path(folder), progress=say, tied=True)
        try:
            local.up(shape, crds=binaries.repo_root() / "crds", peers=True)
        except Exception as error:
            local.down(quiet=True)
            raise SystemExit(f"the cluster with peers could not start: {error}") from error
        api = k8s_client.from_kubeconfig(local.kubeconfig)
        try:
            prepare(api, shape)
            for name in args.systems.split(","):
                system: System
                if name == "matrixpool":
                    system = Matrixpool(api, shape, local.kubeconfig, args.locality_wait)
                elif name == "kube-scheduler":
                    system = KubeScheduler(api, shape)
                else:
                    system = Kueue(api, shape)
                try:
                    phases = set(args.phases.split(","))
                    results[name] = run_system(system, api, shape, trace, say, phases)
                except Exception as error:
                    say(f"[{name}] failed: {error!r}")
                    results[name] = {"error": f"{type(error).__name__}: {error}"}
                clean(api)
                wait_for(lambda: not api.core.list_namespaced_pod(NAMESPACE).items, 300, "clean")
        finally:
            local.down(quiet=True)
    png_error = write_png(args.png, results, shape.node_count * shape.cards_per_node)
    report: dict[str, Any] = {
        "trace": {"gangs": len(trace), "seconds": args.seconds, "seed": args.seed},
        "matrixpool_locality_wait_seconds": args.locality_wait,
        "cluster": {
            "supernodes": shape.supernodes,
            "nodes": shape.node_count,
            "cards": shape.node_count * shape.cards_per_node,
        },
        "systems": {
            name: {k: v for k, v in figures.items() if k not in ("utilisation", "placements")}
            for name, figures in results.items()
        },
        "png": str(args.png) if png_error is None else png_error,
    }
    report["goals"] = goals(report["systems"])
    if args.dump:
        dump = {name: figures.get("placements") for name, figures in results.items()}
        args.dump.write_text(json.dumps({"trace": report["trace"], "systems": dump}))
    print(json.dumps(report))
    return 0


def goals(systems: dict[str, Any]) -> dict[str, Any]:
    """Ratios from this run: per-gang p50 against the better peer and against kube-scheduler,
    pods per second against kube-scheduler, idle card-hours against the better peer, partly
    bound gangs, extra racks against Kueue's and kube-scheduler's (issue 34's goals)."""
    ours = systems.get("matrixpool") or {}
    peers = [
        systems[p]
        for p in ("kube-scheduler", "kueue")
        if "error" not in systems.get(p, {"error": 1})
    ]
    if "error" in ours or not peers:
        return {}
    result: dict[str, Any] = {}
    if "gang_p50_s" in ours:
        best_p50 = min(p["gang_p50_s"] for p in peers if p.get("gang_p50_s") is not None)
        best_idle = min(p["idle_card_hours"] for p in peers)
        result["p50_vs_best_peer"] = round(ours["gang_p50_s"] / best_p50, 3)
        result["idle_vs_best_peer"] = (
            round(ours["idle_card_hours"] / best_idle, 3) if best_idle else None
        )
        result["partial_gangs"] = ours["partial_gangs"]
    kube = systems.get("kube-scheduler") or {}
    queue = systems.get("kueue") or {}
    if "extra_racks" in ours:
        for name, peer in (("kueue", queue), ("kube_scheduler", kube)):
            if "extra_racks" in peer:
                result[f"extra_racks_vs_{name}"] = (
                    round(ours["extra_racks"] / peer["extra_racks"], 3)
                    if peer["extra_racks"]
                    else (0.0 if not ours["extra_racks"] else None)
                )
    if ours.get("gang_p50_s") and kube.get("gang_p50_s"):
        result["p50_vs_kube_scheduler"] = round(ours["gang_p50_s"] / kube["gang_p50_s"], 3)
    if "pods_per_second" in kube:
        result["pods_per_second_vs_kube_scheduler"] = round(
            ours["pods_per_second"] / kube["pods_per_second"], 3
        )
    return result


if __name__ == "__main__":
    raise SystemExit(main())
