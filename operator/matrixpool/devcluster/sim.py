"""``matrixpool sim``: the stand-in for kubelets and trainers on the local cluster.

For every simulated node (of the chosen supernodes) it runs one real checkpoint daemon
(``matrixpool-ckpt-daemon``) on a loopback address of its own and announces it with a Lease in
the operator's namespace, as the chart's ``matrixpool announce`` does
(:mod:`matrixpool.k8s.daemonleases`); the operator tells the daemons their tier-1 peers
(:mod:`matrixpool.handlers.peers`). For every Running pod of a TrainingJob it runs a
trainer process (:mod:`matrixpool.devcluster.trainer`) with the real Checkpointer, and the plain
``value`` env entries of the pod's first container (so a pod that sets ``MATRIXPOOL_SIM_STEPS``
trains that many steps and exits 0); the sim's own settings (identity, daemon, token) win over
the pod's. A trainer that exits makes its pod Succeeded (code 0) or Failed, as a kubelet
reports a container of a restartPolicy Never pod. A node that
goes NotReady or is deleted loses its daemon and trainers at once (SIGKILL: its memory is gone);
when it comes back it gets a fresh, empty daemon. Used by the chaos tests, the demo and users who
want to rehearse a recovery.

Credentials as the chart sets them up: the daemons read the cluster secret from
``<folder>/secret`` (0600; ``<folder>/token`` links to it for older scripts, and the operator
reads it through ``MATRIXPOOL_CKPT_SECRET_FILE``);
each trainer gets the token of its own job only.

Reconciles every :data:`PERIOD` seconds from the API; safe to restart (it adopts nothing: old
processes die with it).
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matrixpool import checkpoints
from matrixpool.api import labels
from matrixpool.devcluster import cluster, faults
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import daemonleases
from matrixpool_recovery import credentials

PERIOD = 0.25  # seconds between reconciliations
LEASE_SECONDS = 40  # the daemons' Leases, as the chart's default (renewed every 10 s)
RENEWALS_PER_PASS = 8  # Lease renewals per reconciliation at most (32/s: 320 nodes per 10 s)
PORT = 7040  # every daemon listens on this port of its own loopback address (--port)


@dataclass
class Process:
    """A child process and the file its output goes to."""

    popen: subprocess.Popen[bytes]
    log: Path
    ready_file: Path | None = None  # written by a daemon once it serves

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self) -> bool:
        return self.alive() and (self.ready_file is None or self.ready_file.exists())

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()


@dataclass
class Sim:
    """The simulation of one local cluster's kubelets and trainers."""

    kubeconfig: Path | None
    folder: Path
    supernodes: frozenset[str] = frozenset()  # empty: every supernode
    step_seconds: float = 0.5
    state_bytes: int = 64 << 10
    secret: str = field(default_factory=lambda: secrets.token_hex(32))  # the cluster secret
    port: int = field(default_factory=lambda: PORT)  # two sims on one machine need two ports
    persistent_root: Path | None = None  # tier-3 URIs must be inside; None: <folder>/persistent
    daemons: dict[str, Process] = field(default_factory=dict)  # node → its daemon
    trainers: dict[str, Process] = field(default_factory=dict)  # pod uid → its trainer
    addresses: dict[str, str] = field(default_factory=dict)  # node → loopback address
    namespace: str = "default"  # the operator's: where the daemons' Leases go
    announced: dict[str, float] = field(default_factory=dict)  # node → last Lease renewal
    annotations: dict[str, str] = field(default_factory=dict)  # pod uid -> file content written

    def __post_init__(self) -> None:
        self.api = k8s_client.from_kubeconfig(self.kubeconfig)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.secret_file.unlink(missing_ok=True)
        self.secret_file.touch(mode=0o600)  # never readable by others, not even for a moment
        self.secret_file.write_text(self.secret + "\n")
        token_file = self.folder / "token"  # its earlier name (MATRIXPOOL_CKPT_TOKEN_FILE)
        token_file.unlink(missing_ok=True)
        token_file.symlink_to(self.secret_file.name)

    @property
    def secret_file(self) -> Path:
        """The cluster secret: for the daemons and the operator only."""
        return self.folder / "secret"

    # ---- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self.reconcile()
                except Exception as error:  # the API restarting, a node vanishing: retry
                    print(f"sim: reconcile failed, retrying: {error}", file=sys.stderr)
                stop.wait(PERIOD)
        finally:
            self.shutdown()

    def reconcile(self) -> None:
        """1 nodes and their daemons, 2 their Leases, 3 trainers. (The operator tells the
        daemons their tier-1 peers, as in a real cluster.)"""
        nodes = self.nodes()
        healthy = {name for name, node in nodes.items() if _ready(node)}
        serving = {name for name in healthy if not _daemon_down(nodes[name])}
        for name in list(self.daemons):
            if name not in healthy or not self.daemons[name].alive():
                self.lose_node(name)
            elif name not in serving:
                self.lose_daemon(name)
        for name in sorted(serving - set(self.daemons)):
            self.start_daemon(name)
        self.publish(nodes)
        self.reconcile_trainers(healthy)

    def shutdown(self) -> None:
        for process in [*self.trainers.values(), *self.daemons.values()]:
            process.kill()
        self.trainers.clear()
        self.daemons.clear()

    # ---- phase 1: daemons ------------------------------------------------------------------

    def nodes(self) -> dict[str, Any]:
        chosen = f" in ({','.join(sorted(self.supernodes))})" if self.supernodes else ""
        found = {}
        for node in self.api.core.list_node(label_selector=labels.SUPERNODE + chosen).items:
            supernode = (node.metadata.labels or {}).get(labels.SUPERNODE)
            if supernode and (not self.supernodes or supernode in self.supernodes):
                found[node.metadata.name] = node
        return found

    def address(self, node: str) -> str:
        """A loopback address of the node's own: 127.1.x.y, stable for the sim's life."""
        if node not in self.addresses:
            index = len(self.addresses) + 1
            self.addresses[node] = f"127.1.{index // 250}.{index % 250 + 1}"
        return self.addresses[node]

    def endpoint(self, node: str) -> str:
        return f"{self.address(node)}:{self.port}"

    def start_daemon(self, node: str) -> None:
        memory = self.folder / "memory" / node
        shutil.rmtree(memory, ignore_errors=True)  # a node that comes back has empty memory
        log = self.folder / "logs" / f"daemon-{node}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        ready = self.folder / "ready" / node
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        args = [
            _script("matrixpool-ckpt-daemon"),
            f"--listen={self.endpoint(node)}",
            f"--node={node}",
            f"--data-dir={self.folder / 'disk' / node}",
            f"--memory-dir={memory}",
            "--memory-bytes=256Mi",
            "--memory-headroom=32Mi",
            f"--secret-file={self.secret_file}",
            f"--persistent-root={self.persistent_root or self.folder / 'persistent'}",
            "--log-level=WARNING",
            f"--ready-file={ready}",
        ]
        self.daemons[node] = _spawn(args, log)
        self.daemons[node].ready_file = ready
        self.announced.pop(node, None)  # a new daemon writes its endpoint afresh

    def publish(self, nodes: dict[str, Any]) -> None:
        """Announce each serving daemon with its Lease in the operator's namespace, renewed
        every quarter of :data:`LEASE_SECONDS` — what ``matrixpool announce`` does beside a
        real daemon (:mod:`matrixpool.k8s.daemonleases`); a daemon that died is no longer
        renewed. A new daemon is announced at once; renewals are spread over the passes (at
        most :data:`RENEWALS_PER_PASS`, the most overdue first, unless some are half a
        duration old: then all of those), so that a hundred Leases falling due together never
        hold up the trainers' reconciliation."""
        now = time.monotonic()
        serving = [n for n in sorted(nodes) if (d := self.daemons.get(n)) and d.ready()]
        new = [n for n in serving if n not in self.announced]
        due = sorted(
            (n for n in serving if n in self.announced),
            key=lambda n: self.announced[n],
        )
        due = [n for n in due if now - self.announced[n] >= LEASE_SECONDS / 4]
        late = [n for n in due if now - self.announced[n] >= LEASE_SECONDS / 2]  # all of them
        for node in [*new, *(late or due[:RENEWALS_PER_PASS])]:
            daemonleases.announce(
                self.api,
                self.namespace,
                node,
                self.endpoint(node),
                duration=LEASE_SECONDS,
                first=node in new,
            )
            self.announced[node] = now
        ready = self.folder / "serving"
        if not ready.exists() and nodes and all(n in self.announced for n in nodes):
            ready.write_text(f"{len(nodes)} daemons\n")  # for scripts that wait for the sim

    def lose_node(self, node: str) -> None:
        """The node is down or gone: its daemon and trainers die, its memory with them."""
        for uid, trainer in list(self.trainers.items()):
            if trainer.log.name.startswith(f"{node}."):
                trainer.kill()
                del self.trainers[uid]
        self.lose_daemon(node)

    def lose_daemon(self, node: str) -> None:
        """The daemon dies (its memory with it); the node's trainers run on, unable to save.
        Its Lease is no longer renewed."""
        self.daemons.pop(node).kill()
        self.announced.pop(node, None)
        shutil.rmtree(self.folder / "memory" / node, ignore_errors=True)

    # ---- phase 3: trainers -------------------------------------------------------------------

    def reconcile_trainers(self, healthy: set[str]) -> None:
        """A trainer per Running pod on a healthy node; a trainer that exits on its own ends
        its pod, Succeeded on exit 0 else Failed (the kubelet's part, restartPolicy Never);
        each trainer sees its pod's
        annotations in a file, as a downward-API volume would show them."""
        pods = self.api.core.list_pod_for_all_namespaces(
            label_selector=f"{labels.KIND}=TrainingJob"
        ).items
        wanted = {
            p.metadata.uid: p
            for p in pods
            if p.status.phase == "Running"
            and p.spec.node_name in healthy
            and not p.metadata.deletion_timestamp
        }
        for uid in list(self.trainers):
            trainer = self.trainers[uid]
            if uid in wanted and not trainer.alive():
                self.end_pod(wanted.pop(uid), trainer)
            if uid not in wanted or not trainer.alive():
                self.trainers.pop(uid).kill()
                self.annotations.pop(uid, None)
        jobs: dict[tuple[str, str], list[Any]] = {}
        for pod in pods:
            key = (pod.metadata.namespace, pod.metadata.labels.get(labels.JOB, ""))
            if not pod.metadata.deletion_timestamp:
                jobs.setdefault(key, []).append(pod)
        for uid, pod in wanted.items():
            self.write_annotations(pod)
            daemon = self.daemons.get(pod.spec.node_name)
            if uid not in self.trainers and daemon is not None and daemon.ready():
                self.start_trainer(
                    pod, jobs[(pod.metadata.namespace, pod.metadata.labels[labels.JOB])]
                )

    def annotations_file(self, uid: str) -> Path:
        return self.folder / "annotations" / uid

    def write_annotations(self, pod: Any) -> None:
        """The pod's annotations as ``key="value"`` lines (the downward API's format)."""
        annotations = pod.metadata.annotations or {}
        content = "".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(annotations.items()))
        uid = pod.metadata.uid
        if self.annotations.get(uid) == content:
            return
        path = self.annotations_file(uid)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(content)
        temporary.replace(path)
        self.annotations[uid] = content

    def end_pod(self, pod: Any, trainer: Process) -> None:
        """The trainer exited: the pod Succeeded (code 0) or Failed, as a kubelet reports the
        one container of a restartPolicy Never pod."""
        code = trainer.popen.returncode
        status = {
            "phase": "Succeeded" if code == 0 else "Failed",
            "reason": "Completed" if code == 0 else "Error",
            "message": f"trainer exited with code {code} (log {trainer.log.name})",
        }
        try:
            self.api.core.patch_namespaced_pod_status(
                pod.metadata.name, pod.metadata.namespace, {"status": status}
            )
        except Exception as error:  # the pod may be gone already
            print(f"sim: could not end pod {pod.metadata.name}: {error}", file=sys.stderr)

    def start_trainer(self, pod: Any, gang: list[Any]) -> None:
        namespace, job = pod.metadata.namespace, pod.metadata.labels[labels.JOB]
        body = self.api.custom.get_namespaced_custom_object(
            "matrixpool.dev", "v1alpha1", namespace, "trainingjobs", job
        )
        checkpoint = (body.get("spec") or {}).get("checkpoint") or {"memory": {"everySteps": 1}}
        others = sorted({p.spec.node_name for p in gang if p.spec.node_name} - {pod.spec.node_name})
        restore = (pod.metadata.annotations or {}).get(labels.RESTORE, "")
        job_key = body["metadata"]["uid"]  # the job's checkpoints and its token are keyed by it
        env = {
            **pod_env(pod),  # the sim's own settings below win
            "MATRIXPOOL_JOB": job_key,
            "MATRIXPOOL_RANK": pod.metadata.labels[labels.RANK],
            "MATRIXPOOL_WORLD_SIZE": str(_world_size(gang)),
            "MATRIXPOOL_CKPT_DAEMON": self.endpoint(pod.spec.node_name),
            "MATRIXPOOL_CKPT_TOKEN": credentials.job_token(self.secret, job_key),
            "MATRIXPOOL_CKPT_PEERS": ",".join(self.endpoint(n) for n in others),
            "MATRIXPOOL_CHECKPOINT": json.dumps(checkpoint),
            "MATRIXPOOL_RESTORE": restore,
            "MATRIXPOOL_INCARNATION": str(_incarnation(gang)),
            "MATRIXPOOL_ANNOTATIONS_FILE": str(self.annotations_file(pod.metadata.uid)),
            "MATRIXPOOL_SIM_BARRIER": str(
                self.folder / "barriers" / f"{namespace}.{job}.w{_world_size(gang)}"
            ),
            "MATRIXPOOL_SIM_STEP_SECONDS": str(self.step_seconds),
            "MATRIXPOOL_SIM_STATE_BYTES": str(self.state_bytes),
        }
        log = self.folder / "trainers" / f"{pod.spec.node_name}.{namespace}.{pod.metadata.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        trainer = _spawn([sys.executable, "-m", "matrixpool.devcluster.trainer"], log, env)
        self.trainers[pod.metadata.uid] = trainer
        log.with_suffix(".pid").write_text(str(trainer.popen.pid))


def pod_env(pod: Any) -> dict[str, str]:
    """The plain ``value`` env entries of the pod's first container, as its process would
    see them. ``valueFrom`` entries are left out (the sim resolves no field or Secret), and so
    is the token file the pod mounts from its Secret: the sim hands the token itself."""
    containers = pod.spec.containers or []
    entries = (containers[0].env or []) if containers else []
    return {
        e.name: e.value for e in entries if e.value is not None and e.name != labels.ENV_TOKEN_FILE
    }


def _world_size(gang: list[Any]) -> int:
    """Ranks of the job, as its live pods tell (status.replicas would lag a shrink)."""
    ranks = {p.metadata.labels.get(labels.RANK) for p in gang}
    return max(len(ranks), 1)


def _incarnation(gang: list[Any]) -> int:
    """The run the job is in: the newest incarnation its pods' restore annotations name (a
    rank added by elastic growth joins it); a gang none of whose pods was told to restore
    started afresh when its oldest pod was created (milliseconds, so that a restart after a
    preemption is newer than every recovery before it)."""
    named = 0
    for pod in gang:
        try:
            asked = checkpoints.parse_restore((pod.metadata.annotations or {}).get(labels.RESTORE))
        except ValueError:
            continue
        if asked is not None and asked.incarnation is not None:
            named = max(named, asked.incarnation)
    if named:
        return named
    created = [p.metadata.creation_timestamp for p in gang if p.metadata.creation_timestamp]
    return int(min(created).timestamp() * 1000) if created else 0


def _daemon_down(node: Any) -> bool:
    return (node.metadata.annotations or {}).get(faults.DAEMON_FAULT_ANNOTATION) == "down"


def _ready(node: Any) -> bool:
    conditions = (node.status.conditions or []) if node.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _script(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else name


def _spawn(args: Iterable[str], log: Path, env: dict[str, str] | None = None) -> Process:
    """A child that dies with the sim, however the sim ends (no daemon outlives it)."""
    import os

    with open(log, "ab") as out:
        popen = subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            preexec_fn=cluster._die_with_parent,
        )
    return Process(popen, log)
