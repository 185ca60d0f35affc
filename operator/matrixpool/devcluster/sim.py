"""``matrixpool sim``: the stand-in for the kubelets of the local cluster's simulated nodes.

For every simulated node (of the chosen supernodes) it runs one real checkpoint daemon
(``matrixpool-ckpt-daemon``) on the node's address (its ``InternalIP``: a loopback address of
its own, given when ``cluster up`` created the node), as the chart's host-network DaemonSet
would, and announces it with a Lease in the operator's namespace, as the chart's ``matrixpool
announce`` does (:mod:`matrixpool.k8s.daemonleases`); the operator tells the daemons their
tier-1 peers (:mod:`matrixpool.controllers.daemons`).

It is the **process kubelet** of those nodes: every pod bound to one of them whose containers'
image is the matrixpool image (``--image``, any registry and tag) runs as processes on this
machine — each container's ``command``/``args`` with exactly the pod's environment, resolved as
a kubelet resolves it (``$(VAR)``, downward API, Secrets, ConfigMaps; see
:mod:`matrixpool.devcluster.kubelet`), in a mount namespace of its own in which every volume is
bound at its ``mountPath``: Secret, ConfigMap, downward-API (kept current) and projected
volumes as files, emptyDir as a folder of the pod, hostPath as a folder of the node
(``<folder>/nodes/<node>/<path>``: what two pods of one node share, and nothing else), with
the ``/etc/resolv.conf`` and ``/etc/hosts`` a kubelet writes bound over the machine's and its
hostname in a UTS namespace. Names resolve as on a real node: a ``ClusterFirst`` pod asks the
cluster's CoreDNS (on its loopback address, which the kube-dns Service publishes:
:mod:`matrixpool.devcluster.dns`), which answers ``<pod>.<service>.<ns>.svc.cluster.local``
with the pod's address (kwok's, on loopback: 127.200.0.0/16; :mod:`.loopbackdns`). The sim
adds nothing of its own: a trainer that works under it works the same in a real pod. Exits
are reported as a kubelet reports them: per ``restartPolicy`` the container restarts (with
``restartCount``) or the pod ends ``Succeeded`` (every container exited 0) or ``Failed``.
Other pods are left to kwok, which only reports them Running. kwok still reports the sim's
pods Running (and their ``hostIP``) once bound; the sim starts their containers then.

A deleted pod's processes get SIGTERM, and SIGKILL after its grace period if they still run,
as a kubelet ends them (a server drains meanwhile); a container's ``lifecycle.preStop.sleep``
delays the SIGTERM by its seconds within that grace, as a kubelet runs the hook first (an
engine that stops at once on SIGTERM finishes its requests meanwhile; the longest sleep of the
pod's containers holds them all; ``preStop.exec`` and ``httpGet`` are not run). A node that
goes NotReady or is deleted loses its daemon and its pods' processes at once (SIGKILL: its
memory is gone); when it comes back it gets a fresh, empty daemon. The daemons
run with the node's tier-1 folder bound at ``--memory-path`` (the chart's
``checkpointDaemon.memoryPath``), so the buffer paths they hand out are the ones a pod sees
through its hostPath volume. Needs root (mount namespaces).

Credentials as the chart sets them up: the daemons read the cluster secret from
``<folder>/secret`` (0600; ``<folder>/token`` links to it for older scripts, and the operator
reads it through ``MATRIXPOOL_CKPT_SECRET_FILE``); a pod gets its job's token from the Secret
the operator writes, like any other Secret.

Reconciles every :data:`PERIOD` seconds from the API; safe to restart (it adopts nothing: old
processes die with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matrixpool import clock
from matrixpool.api import labels
from matrixpool.devcluster import cgroups, cluster, dns, faults, kubelet
from matrixpool.k8s import client as k8s_client
from matrixpool.k8s import daemonleases

PERIOD = 0.25  # seconds between reconciliations
LEASE_SECONDS = 40  # the daemons' Leases, as the chart's default (renewed every 10 s)
RENEWALS_PER_PASS = 8  # Lease renewals per reconciliation at most (32/s: 320 nodes per 10 s)
PORT = labels.DAEMON_PORT  # every daemon listens on this port of its node's address (--port)
KV_POOL_BYTES = "64Mi"  # each daemon's part of the KV-cache pool, out of its --memory-bytes
CACHE_SECONDS = 10.0  # how long the process kubelet trusts a Secret or ConfigMap it read
BACKOFF_SECONDS = (1, 2, 4, 8, 10)  # restarts of a container (a kubelet: 10 s doubling to 5 min)
DEFAULT_GRACE_SECONDS = 30.0  # a pod's terminationGracePeriodSeconds when it sets none
DNS_RECHECK_SECONDS = 10.0  # how often the sim looks again for a cluster DNS it did not find


@dataclass
class Process:
    """A child process and the file its output goes to."""

    popen: subprocess.Popen[bytes]
    log: Path
    ready_file: Path | None = None  # written by a daemon once it serves
    # A container's: what it started dies with it, as every process of a container's PID
    # namespace dies with the namespace's init (torchrun's workers when torchrun is killed,
    # though torchrun starts each in a session of its own). ``cgroup``: the container's cgroup
    # (v2), whose every process is killed; None where there is none to make: its process group.
    group: bool = False
    cgroup: Path | None = None
    cpu_cgroup: Path | None = None  # its CPU limit's, in the v1 cpu hierarchy (a hybrid host)
    swept: bool = False

    def alive(self) -> bool:
        if self.popen.poll() is None:
            return True
        self._sweep()
        return False

    def ready(self) -> bool:
        return self.alive() and (self.ready_file is None or self.ready_file.exists())

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()
        self._sweep()

    def _sweep(self) -> None:
        """SIGKILL to what is left of the container, once, after its process ended."""
        if not self.group or self.swept:
            return
        self.swept = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        for group in (self.cgroup, self.cpu_cgroup):
            if group is not None:
                cgroups.kill(group)

    def terminate(self) -> None:
        """SIGTERM: the process may finish what it does (a kubelet's first signal)."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)


@dataclass
class Container:
    """One container of a pod the sim runs: its process while it runs, what it last did."""

    name: str
    process: Process | None = None
    restarts: int = 0
    started: str = ""  # RFC 3339, the current or last run
    exit_code: int | None = None  # of the last run
    finished: str = ""
    not_before: float = 0.0  # monotonic: a restart waits for its back-off


@dataclass
class PodRun:
    """A pod the sim runs on one of its nodes."""

    uid: str
    namespace: str
    name: str
    node: str
    folder: Path  # its volumes live here
    containers: dict[str, Container] = field(default_factory=dict)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # volume -> files written
    inits: dict[str, Container] = field(default_factory=dict)  # its init containers
    initialized: bool = False  # every init container exited 0
    ended: bool = False  # phase Succeeded or Failed reported
    waiting: str = ""  # why its containers have not started yet (printed once)
    grace: float = DEFAULT_GRACE_SECONDS  # spec.terminationGracePeriodSeconds, last seen
    pre_stop: float = 0.0  # the longest lifecycle.preStop.sleep.seconds of its containers
    kill_at: float | None = None  # monotonic: terminating (SIGKILL then)
    term_at: float | None = None  # monotonic: SIGTERM due (after the preStop sleep); None: sent

    def processes(self) -> list[Process]:
        every = [*self.inits.values(), *self.containers.values()]
        return [c.process for c in every if c.process is not None]


class ApiLookup:
    """Secrets, ConfigMaps and tokens as the kubelet reads them, cached as a kubelet caches
    them: what exists for :data:`CACHE_SECONDS` (a changed Secret reaches a pod's files
    within that; a kubelet takes up to a minute), what is missing for a second (a pod waiting
    for its Secret starts soon after it appears), a service-account token until 80% of its
    life."""

    def __init__(self, api: k8s_client.Api) -> None:
        self.api = api
        self.cache: dict[tuple[str, str, str], tuple[float, Mapping[str, bytes] | None]] = {}
        self.tokens: dict[tuple[str, ...], tuple[float, str]] = {}

    def _read(self, kind: str, namespace: str, name: str) -> Mapping[str, bytes] | None:
        key = (kind, namespace, name)
        now = time.monotonic()
        cached = self.cache.get(key)
        if cached is not None and now < cached[0]:
            return cached[1]
        found: Mapping[str, bytes] | None
        try:
            if kind == "Secret":
                raw = self.api.core.read_namespaced_secret(name, namespace, _preload_content=False)
                found = kubelet.encoded(json.loads(raw.data).get("data") or {})
            else:
                raw = self.api.core.read_namespaced_config_map(
                    name, namespace, _preload_content=False
                )
                data = json.loads(raw.data).get("data") or {}
                found = {k: str(v).encode() for k, v in data.items()}
        except Exception as error:
            if not k8s_client.is_status(error, 404):
                raise
            found = None
        self.cache[key] = (now + (CACHE_SECONDS if found is not None else 1.0), found)
        return found

    def secret(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return self._read("Secret", namespace, name)

    def config_map(self, namespace: str, name: str) -> Mapping[str, bytes] | None:
        return self._read("ConfigMap", namespace, name)

    def token(
        self,
        namespace: str,
        account: str,
        audience: str | None,
        seconds: int,
        pod: tuple[str, str] | None = None,
    ) -> str:
        key = (namespace, account, audience or "", *(pod or ("", "")))
        now = time.monotonic()
        cached = self.tokens.get(key)
        if cached is not None and now < cached[0]:
            return cached[1]
        life = max(seconds, 600)
        spec: dict[str, Any] = {"expirationSeconds": life}
        if audience:
            spec["audiences"] = [audience]
        if pod is not None:  # as a kubelet asks: the pod's node goes into the token's claims
            name, uid = pod
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": name, "uid": uid}
        answer = self.api.core.create_namespaced_service_account_token(
            account, namespace, {"spec": spec}
        )
        token = str(answer.status.token)
        self.tokens[key] = (now + 0.8 * life, token)
        return token

    def forget(self) -> None:
        """Drop what expired (called once a pass)."""
        now = time.monotonic()
        self.cache = {k: v for k, v in self.cache.items() if now < v[0]}
        self.tokens = {k: v for k, v in self.tokens.items() if now < v[0]}


_cpu_root = cgroups.cpu_root  # (the Sim's field ``cgroups`` shadows the module in its body)


@dataclass
class Sim:
    """The simulation of one local cluster's kubelets (daemons and the pods they run)."""

    kubeconfig: Path | None
    folder: Path
    supernodes: frozenset[str] = frozenset()  # empty: every supernode
    secret: str = field(default_factory=lambda: secrets.token_hex(32))  # the cluster secret
    port: int = field(default_factory=lambda: PORT)  # two sims on one machine need two ports
    persistent_root: Path | None = None  # tier-3 URIs must be inside; None: <folder>/persistent
    memory_path: str = labels.MEMORY_PATH  # the daemons' tier-1 folder, as pods mount it
    kv_pool_bytes: str = KV_POOL_BYTES  # each daemon's part of the KV-cache pool
    image: str = kubelet.IMAGE  # pods of this image run as processes
    daemons_from: str = "sim"  # "sim": it runs a daemon per node; "chart": the DaemonSet's pods
    shared_paths: tuple[str, ...] = ()  # host paths every node shares (a shared file system)
    daemon_down: set[str] = field(default_factory=set)  # nodes whose daemon a fault keeps down
    healthy_before: set[str] = field(default_factory=set)  # Ready nodes of the last pass
    daemons: dict[str, Process] = field(default_factory=dict)  # node → its daemon
    pods: dict[str, PodRun] = field(default_factory=dict)  # pod uid → what runs of it
    addresses: dict[str, str] = field(default_factory=dict)  # node → its InternalIP
    namespace: str = "default"  # the operator's: where the daemons' Leases go
    announced: dict[str, float] = field(default_factory=dict)  # node → last Lease renewal
    dns: kubelet.ClusterDNS | None = None  # the cluster's DNS as last looked up
    dns_checked: float = 0.0  # monotonic: when it was looked up
    cgroups: Path | None = field(default_factory=cgroups.root)  # the containers' cgroups
    cpu_cgroups: Path | None = field(default_factory=_cpu_root)  # their CPU limits' (v1)

    def __post_init__(self) -> None:
        self.api = k8s_client.from_kubeconfig(self.kubeconfig)
        self.lookup = ApiLookup(self.api)
        self.folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.folder / "pods", ignore_errors=True)  # volumes of an earlier run
        for stale in (self.folder / "trainers").glob("*.pid"):  # its processes died with it
            stale.unlink(missing_ok=True)
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
        """1 nodes and their daemons, 2 their Leases, 3 the pods bound to them. (The operator
        tells the daemons their tier-1 peers, as in a real cluster.)"""
        nodes = self.nodes()
        healthy = {name for name, node in nodes.items() if _ready(node)}
        serving = {name for name in healthy if not _daemon_down(nodes[name])}
        self.daemon_down = healthy - serving
        for name in self.healthy_before - healthy:  # a node down loses its memory (tmpfs)
            shutil.rmtree(self.node_folder(name, self.memory_path), ignore_errors=True)
        self.healthy_before = healthy
        if self.daemons_from == "sim":
            for name in list(self.daemons):
                if name not in healthy or not self.daemons[name].alive():
                    self.lose_node(name)
                elif name not in serving:
                    self.lose_daemon(name)
            for name in sorted(serving - set(self.daemons)):
                self.start_daemon(name)
            self.publish(nodes)
        self.reconcile_pods(set(nodes), healthy)

    def shutdown(self) -> None:
        """The sim stopped: its processes go, and the Leases of its daemons with them (stopped,
        not failed: a stale Lease would mark the node unreachable for whatever runs next)."""
        for run in self.pods.values():
            for process in run.processes():
                process.kill()
        for process in self.daemons.values():
            process.kill()
        for node in sorted(self.announced):
            try:
                withdraw_lease(self.api, self.namespace, node)
            except Exception as error:  # the API gone first: the Lease just goes stale
                print(f"sim: could not withdraw {node}'s Lease: {error}", file=sys.stderr)
        self.pods.clear()
        self.daemons.clear()
        self.announced.clear()
        cgroups.remove(self.cgroups)
        cgroups.remove(self.cpu_cgroups)

    # ---- phase 1: daemons ------------------------------------------------------------------

    def nodes(self) -> dict[str, Any]:
        chosen = f" in ({','.join(sorted(self.supernodes))})" if self.supernodes else ""
        found = {}
        for node in self.api.core.list_node(label_selector=labels.SUPERNODE + chosen).items:
            supernode = (node.metadata.labels or {}).get(labels.SUPERNODE)
            if supernode and (not self.supernodes or supernode in self.supernodes):
                found[node.metadata.name] = node
        self.learn_addresses(found)
        return found

    def learn_addresses(self, nodes: Mapping[str, Any]) -> None:
        """Each node's InternalIP, where its daemon listens: they must differ."""
        for name, node in nodes.items():
            addresses = (node.status.addresses or []) if node.status else []
            internal = [a.address for a in addresses if a.type == "InternalIP"]
            if internal:
                self.addresses[name] = internal[0]
        seen: dict[str, str] = {}
        for name in sorted(nodes):
            address = self.addresses.get(name)
            if address is None:
                continue
            if address in seen:
                raise RuntimeError(
                    f"nodes {seen[address]} and {name} share the address {address}: the sim "
                    "runs each node's daemon on its node's InternalIP (create the nodes with "
                    "`matrixpool cluster up`, which gives each its own loopback address)"
                )
            seen[address] = name

    def endpoint(self, node: str) -> str:
        return f"{self.addresses[node]}:{self.port}"

    def node_folder(self, node: str, path: str) -> Path:
        """A host path of ``node``, as a folder of this machine; one under a shared path is
        the same folder on every node (a shared file system mounted on each). ``..`` is
        resolved as on the node (``/../../etc`` is its ``/etc``), and a path that leads out of
        the node's folder (through a link a container made) is refused: ``FailedMount``."""
        inside = posixpath.normpath("/" + path).strip("/")
        root = self.folder / "nodes" / node
        for shared in self.shared_paths:
            prefix = posixpath.normpath("/" + shared).strip("/")
            if inside == prefix or inside.startswith(prefix + "/"):
                root = self.folder / "shared"
                break
        folder = root / inside
        if not folder.resolve().is_relative_to(root.resolve()):
            raise kubelet.NotReadyError("FailedMount", f"hostPath {path} leads out of {node}")
        return folder

    def start_daemon(self, node: str) -> None:
        if node not in self.addresses:
            return  # no address yet: kwok has not initialised the node
        memory = self.node_folder(node, self.memory_path)
        shutil.rmtree(memory, ignore_errors=True)  # a node that comes back has empty memory
        memory.mkdir(parents=True)
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
            f"--memory-dir={self.memory_path}",
            "--memory-bytes=256Mi",
            "--memory-headroom=32Mi",
            f"--kv-pool-bytes={self.kv_pool_bytes}",
            f"--secret-file={self.secret_file}",
            f"--persistent-root={self.persistent_root or self.folder / 'persistent'}",
            "--log-level=WARNING",
            f"--ready-file={ready}",
        ]
        mounts = [kubelet.Mount(str(memory), self.memory_path)]  # the DaemonSet's hostPath
        self.daemons[node] = _spawn(kubelet.launcher(mounts, args), log)
        self.daemons[node].ready_file = ready
        self.announced.pop(node, None)  # a new daemon writes its endpoint afresh

    def publish(self, nodes: dict[str, Any]) -> None:
        """Announce each serving daemon with its Lease in the operator's namespace, renewed
        every quarter of :data:`LEASE_SECONDS` — what ``matrixpool announce`` does beside a
        real daemon (:mod:`matrixpool.k8s.daemonleases`); a daemon that died is no longer
        renewed. A new daemon is announced at once; renewals are spread over the passes (at
        most :data:`RENEWALS_PER_PASS`, the most overdue first, unless some are half a
        duration old: then all of those), so that a hundred Leases falling due together never
        hold up the pods' reconciliation."""
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
        """The node is down or gone: its daemon and pods' processes die, its memory with them."""
        for uid, run in list(self.pods.items()):
            if run.node == node:
                for process in run.processes():
                    process.kill()
                del self.pods[uid]
        self.lose_daemon(node)

    def lose_daemon(self, node: str) -> None:
        """The daemon dies (its memory with it); the node's pods run on, unable to save.
        Its Lease is no longer renewed."""
        self.daemons.pop(node).kill()
        self.announced.pop(node, None)
        shutil.rmtree(self.node_folder(node, self.memory_path), ignore_errors=True)

    # ---- phase 3: the process kubelet ------------------------------------------------------

    def reconcile_pods(self, nodes: set[str], healthy: set[str]) -> None:
        """Run the containers of every Running pod of the matrixpool image bound to a healthy
        node of the sim; end what no longer should run; report exits."""
        raw = self.api.core.list_pod_for_all_namespaces(
            resource_version="0",
            _preload_content=False,  # from the watch cache, as kubelets
        )
        listed = [
            p
            for p in json.loads(raw.data).get("items", [])
            if (p.get("spec") or {}).get("nodeName") in nodes and kubelet.runs_here(p, self.image)
        ]
        by_uid = {p["metadata"]["uid"]: p for p in listed}
        for uid in list(self.pods):
            pod = by_uid.get(uid)
            run = self.pods[uid]
            if run.node not in healthy:  # the node is lost, and its processes with it
                self.end_run(run)
            elif pod is None or pod["metadata"].get("deletionTimestamp"):
                self.terminate(run, pod)
        lookup = self.lookup
        lookup.forget()
        for uid, pod in by_uid.items():
            node = pod["spec"]["nodeName"]
            if (
                node not in healthy
                or pod["metadata"].get("deletionTimestamp")
                or (pod.get("status") or {}).get("phase") != "Running"
                or node not in self.addresses
            ):
                continue
            if uid not in self.pods:
                self.pods[uid] = PodRun(
                    uid,
                    pod["metadata"]["namespace"],
                    pod["metadata"]["name"],
                    node,
                    self.folder / "pods" / uid,
                )
            run = self.pods[uid]
            run.grace = float(
                pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
            )
            run.pre_stop = kubelet.pre_stop_sleep(pod["spec"])
            try:
                self.run_pod(pod, run, lookup)
            except kubelet.NotReadyError as waiting:
                if run.waiting != str(waiting):
                    run.waiting = str(waiting)
                    print(f"sim: pod {run.namespace}/{run.name} waits: {waiting}", file=sys.stderr)

    def terminate(self, run: PodRun, pod: dict[str, Any] | None) -> None:
        """A deleted pod, as a kubelet ends it: SIGTERM to its processes, SIGKILL to what still
        runs after the grace period (the deletion's, else the pod's own); its folder goes with
        the last process. kwok removes the Pod object at once, so the processes may outlive it
        by up to that grace (a kubelet would keep the object until they end)."""
        now = time.monotonic()
        if run.kill_at is None:
            given = (pod or {}).get("metadata", {}).get("deletionGracePeriodSeconds")
            grace = run.grace if given is None else float(given)
            run.kill_at = now + grace
            run.term_at = now + min(grace, run.pre_stop)
        if run.term_at is not None and now >= run.term_at:
            run.term_at = None
            for process in run.processes():
                if now < run.kill_at:
                    process.terminate()
                else:
                    process.kill()
        if now >= run.kill_at or not any(p.alive() for p in run.processes()):
            self.end_run(run)

    def end_run(self, run: PodRun) -> None:
        for process in run.processes():
            process.kill()
        shutil.rmtree(run.folder, ignore_errors=True)
        self.pods.pop(run.uid, None)

    def run_pod(self, pod: dict[str, Any], run: PodRun, lookup: kubelet.Lookup) -> None:
        """Keep the pod's volume files current, run its init containers one after the other
        (each to exit 0), then start what should run, and report what ended."""
        if run.ended:
            return
        self.write_volumes(pod, run, lookup)
        policy = pod["spec"].get("restartPolicy") or "Always"
        if not self.initialize(pod, run, lookup, policy):
            return
        now = time.monotonic()
        changed = False
        for spec in pod["spec"].get("containers") or []:
            container = run.containers.setdefault(spec["name"], Container(spec["name"]))
            changed = self.reap(container, policy, now) or changed
            if self.stopped(pod, run):
                continue
            first_start = not container.started
            due = container.process is None and (first_start or container.not_before)
            if due and now >= container.not_before:
                self.start_container(pod, run, spec, container, lookup)
                changed = changed or not first_start
        done = all(
            c.process is None and not c.not_before and c.started for c in run.containers.values()
        )
        if done and run.containers:
            run.ended = True
            self.end_pod(pod, run)
        elif changed:
            self.report(pod, run)

    def reap(self, container: Container, policy: str, now: float) -> bool:
        """Whether ``container``'s process exited; if so its restart waits for its back-off
        (``Always``, or ``OnFailure`` after a non-zero exit)."""
        process = container.process
        if process is None or process.alive():
            return False
        code = process.popen.returncode
        container.exit_code = 128 - code if code < 0 else code  # a signal: 128 + its number
        container.finished = _now()
        container.process = None
        if policy == "Always" or (policy == "OnFailure" and container.exit_code):
            container.restarts += 1
            back_off = BACKOFF_SECONDS[min(container.restarts, len(BACKOFF_SECONDS)) - 1]
            container.not_before = now + back_off
        return True

    def initialize(
        self, pod: dict[str, Any], run: PodRun, lookup: kubelet.Lookup, policy: str
    ) -> bool:
        """Whether every init container has exited 0; starts the next one when due. One that
        fails is run again (back-off), unless the pod's restartPolicy is Never: then the pod
        Failed."""
        if run.initialized:
            return True
        now = time.monotonic()
        for spec in pod["spec"].get("initContainers") or []:
            init = run.inits.setdefault(spec["name"], Container(spec["name"]))
            if init.exit_code == 0 and init.process is None:
                continue  # done
            self.reap(init, "OnFailure", now)
            if init.exit_code not in (None, 0) and init.process is None and policy == "Never":
                run.ended = True
                run.containers = {init.name: init}
                self.end_pod(pod, run)
                return False
            if init.process is None and init.exit_code != 0 and now >= init.not_before:
                self.start_container(pod, run, spec, init, lookup)
            return False
        run.initialized = True
        return True

    def stopped(self, pod: dict[str, Any], run: PodRun) -> bool:
        """A checkpoint daemon's pod on a node whose daemon a fault keeps down (``cluster
        fault daemon-down``, when the chart runs the daemons): its processes are killed and
        not started again until ``daemon-up``."""
        if self.daemons_from != "chart" or run.node not in self.daemon_down:
            return False
        component = (pod["metadata"].get("labels") or {}).get("app.kubernetes.io/component")
        if component != "checkpoint-daemon":
            return False
        for container in run.containers.values():
            if container.process is not None:
                container.process.kill()
                container.process = None
                container.exit_code, container.finished = 128 + signal.SIGKILL, _now()
                container.restarts += 1
            container.not_before = time.monotonic()  # starts again once the fault is gone
        return True

    def write_volumes(self, pod: dict[str, Any], run: PodRun, lookup: kubelet.Lookup) -> None:
        """Each file volume's files (rewritten when they change, atomically, as a kubelet
        swaps its ..data link); folders for emptyDir and hostPath volumes."""
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "hostPath" in volume:
                kind = volume["hostPath"].get("type", "")
                folder = self.node_folder(run.node, volume["hostPath"]["path"])
                if kind == "Directory" and not folder.is_dir():
                    raise kubelet.NotReadyError(
                        "FailedMount", f"hostPath {volume['hostPath']['path']} is no folder"
                    )
                if kind in ("DirectoryOrCreate", ""):
                    folder.mkdir(parents=True, exist_ok=True)
                continue
            files = kubelet.volume_files(pod, volume, lookup)
            target = run.folder / "volumes" / name
            if files is None:  # emptyDir
                target.mkdir(parents=True, exist_ok=True)
                continue
            if run.files.get(name) == files:
                continue
            staging = run.folder / "volumes" / f".{name}.new"
            shutil.rmtree(staging, ignore_errors=True)
            for path, data in files.items():
                file = staging / path
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_bytes(data)
            staging.mkdir(parents=True, exist_ok=True)
            if target.exists():  # the container's bind mount holds the folder: swap contents
                for path in files:
                    file = target / path
                    file.parent.mkdir(parents=True, exist_ok=True)
                    (staging / path).replace(file)
                for old in set(run.files.get(name, {})) - set(files):
                    (target / old).unlink(missing_ok=True)
                shutil.rmtree(staging, ignore_errors=True)
            else:
                staging.replace(target)
            run.files[name] = files

    def mounts(
        self, pod: dict[str, Any], run: PodRun, spec: Mapping[str, Any]
    ) -> list[kubelet.Mount]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        found = []
        for mount in spec.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is None:
                raise kubelet.NotReadyError("FailedMount", f"no volume {mount['name']!r}")
            if "hostPath" in volume:
                source = self.node_folder(run.node, volume["hostPath"]["path"])
            else:
                source = run.folder / "volumes" / mount["name"]
            if mount.get("subPath"):  # the API refuses "..": a link must not lead out either
                base, source = source, source / mount["subPath"]
                if not source.resolve().is_relative_to(base.resolve()):
                    raise kubelet.NotReadyError(
                        "FailedMount", f"subPath {mount['subPath']} leads out of its volume"
                    )
            read_only, file = bool(mount.get("readOnly")), source.is_file()  # a subPath key
            found.append(kubelet.Mount(str(source), mount["mountPath"], read_only, file))
        return found

    def start_container(
        self,
        pod: dict[str, Any],
        run: PodRun,
        spec: Mapping[str, Any],
        container: Container,
        lookup: kubelet.Lookup,
    ) -> None:
        env = kubelet.container_env(pod, spec, lookup, self.image_env(pod))
        argv = kubelet.command_line(spec, env)
        mounts = self.mounts(pod, run, spec) + self.network_files(pod, run)
        suffix = "" if spec is pod["spec"]["containers"][0] else f".{spec['name']}"
        log = self.folder / "trainers" / f"{run.node}.{run.namespace}.{run.name}{suffix}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        hostname = kubelet.uts_hostname(pod, self.cluster_dns().domain)
        launch = kubelet.launcher(mounts, argv, _image_folders(), hostname)
        name = f"{run.uid}.{container.name}.{container.restarts}"
        group = cgroups.make(self.cgroups, name)
        cores = cgroups.cpu_cores(((spec.get("resources") or {}).get("limits") or {}).get("cpu"))
        cpu = cgroups.limit_cpu(group, self.cpu_cgroups, name, cores) if cores else None
        container.process = _spawn(cgroups.enter(group, launch, cpu), log, env, inherit=False)
        container.process.cgroup = group
        container.process.cpu_cgroup = cpu
        container.started = _now()
        container.not_before = 0.0
        log.with_suffix(".pid").write_text(str(container.process.popen.pid))
        run.waiting = ""

    def network_files(self, pod: dict[str, Any], run: PodRun) -> list[kubelet.Mount]:
        """The pod's ``/etc/resolv.conf`` and ``/etc/hosts``, written once (a kubelet writes
        them with the sandbox) and bound over the machine's in every container."""
        folder = run.folder / "etc"
        files = {"resolv.conf": folder / "resolv.conf", "hosts": folder / "hosts"}
        if not all(f.exists() for f in files.values()):
            cluster_dns = self.cluster_dns()
            folder.mkdir(parents=True, exist_ok=True)
            files["resolv.conf"].write_text(
                kubelet.resolv_conf(pod, cluster_dns, _read("/etc/resolv.conf"))
            )
            files["hosts"].write_text(
                kubelet.hosts_file(pod, _read("/etc/hosts"), cluster_dns.domain)
            )
        return [kubelet.Mount(str(f), f"/etc/{name}", file=True) for name, f in files.items()]

    def cluster_dns(self) -> kubelet.ClusterDNS:
        """The kubelet's ``clusterDNS``: the loopback address of the cluster's CoreDNS, as its
        kube-dns Service publishes it. None published (a cluster not made by ``cluster up``),
        or not on port 53: no cluster DNS, and ``ClusterFirst`` pods get the machine's
        resolv.conf, as from a kubelet without ``clusterDNS`` (looked for again later)."""
        now = time.monotonic()
        if self.dns is not None and (
            self.dns.nameservers or now < self.dns_checked + DNS_RECHECK_SECONDS
        ):
            return self.dns
        self.dns_checked = now
        try:
            raw = self.api.core.read_namespaced_service(
                "kube-dns", "kube-system", _preload_content=False
            )
            found = dns.published_address(json.loads(raw.data))
        except Exception as error:
            if not k8s_client.is_status(error, 404):
                raise
            found = None
        nameservers = (found[0],) if found and found[1] == dns.PORT else ()
        if not nameservers and self.dns is None:
            print("sim: no cluster DNS on port 53 (kube-system/kube-dns): pods get this "
                  "machine's resolv.conf", file=sys.stderr)  # fmt: skip
        self.dns = kubelet.ClusterDNS(nameservers, dns.DOMAIN)
        return self.dns

    def statuses(self, pod: dict[str, Any], run: PodRun) -> list[dict[str, Any]]:
        found = []
        for spec in pod["spec"].get("containers") or []:
            container = run.containers.get(spec["name"]) or Container(spec["name"])
            terminated = {
                "exitCode": container.exit_code,
                "reason": "Completed" if container.exit_code == 0 else "Error",
                "startedAt": container.started or None,
                "finishedAt": container.finished or None,
            }
            status: dict[str, Any] = {
                "name": spec["name"],
                "image": spec.get("image", ""),
                "imageID": "",
                "restartCount": container.restarts,
                "ready": container.process is not None,
                "started": container.process is not None,
            }
            if container.process is not None:
                status["state"] = {"running": {"startedAt": container.started}}
            elif container.not_before:
                status["state"] = {
                    "waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting"}
                }
            else:
                status["state"] = {"terminated": terminated}
            if container.exit_code is not None and (container.process or container.not_before):
                status["lastState"] = {"terminated": terminated}
            found.append(status)
        return found

    def image_env(self, pod: Mapping[str, Any]) -> dict[str, str]:
        """What a container gets before the pod's env: the image's environment, and where
        the API server is (``KUBERNETES_SERVICE_HOST``/``PORT``: a kubelet names the
        ``kubernetes`` Service, which kube-proxy forwards to the API server; with no
        kube-proxy here, the API server's own address), so that in-cluster clients find it
        with the pod's service-account token."""
        server = urllib.parse.urlsplit(self.api.client.configuration.host)
        return {
            **_image_env(pod),
            "KUBERNETES_SERVICE_HOST": server.hostname or "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(server.port or 443),
            "KUBERNETES_SERVICE_PORT_HTTPS": str(server.port or 443),
        }

    def report(self, pod: dict[str, Any], run: PodRun) -> None:
        """Container states after a restart, as a kubelet reports them."""
        self.patch_status(run, {"containerStatuses": self.statuses(pod, run)})

    def end_pod(self, pod: dict[str, Any], run: PodRun) -> None:
        """Every container ended for good: the pod Succeeded (all exited 0) or Failed."""
        codes = [c.exit_code for c in run.containers.values()]
        succeeded = all(code == 0 for code in codes)
        self.patch_status(
            run,
            {
                "phase": "Succeeded" if succeeded else "Failed",
                "reason": "Completed" if succeeded else "Error",
                "message": f"containers exited with {codes} (log in {self.folder / 'trainers'})",
                "containerStatuses": self.statuses(pod, run),
            },
        )

    def patch_status(self, run: PodRun, status: Mapping[str, Any]) -> None:
        try:
            self.api.core.patch_namespaced_pod_status(run.name, run.namespace, {"status": status})
        except Exception as error:  # the pod may be gone already
            print(f"sim: could not report pod {run.name}: {error}", file=sys.stderr)


def withdraw_lease(api: k8s_client.Api, namespace: str, node: str) -> None:
    """Delete the Lease of ``node``'s daemon (none there is no error): a daemon stopped with
    the sim, not one gone silent. The sim's own, not the announcer's: the chart's announcer
    Role may create and patch Leases only."""
    try:
        api.coordination.delete_namespaced_lease(daemonleases.lease_name(node), namespace)
    except Exception as error:
        if not k8s_client.is_status(error, 404):
            raise


def _image_env(pod: Mapping[str, Any]) -> dict[str, str]:
    """The environment of the matrixpool image, stood in for by the sim's own installation
    (its Python first on PATH), plus HOSTNAME as a runtime sets it (the pod's hostname; the
    machine's for a host-network pod)."""
    env = {
        "PATH": os.pathsep.join(
            [str(Path(sys.executable).parent), os.defpath.strip(":") or "/usr/bin:/bin"]
        ),
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "HOSTNAME": kubelet.uts_hostname(pod) or socket.gethostname(),
    }
    if os.environ.get("PYTHONPATH"):  # a checkout run from its source tree
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _image_folders() -> list[str]:
    """What stands in for the matrixpool image: the sim's Python installation (its virtualenv
    and the base interpreter's prefix) and the source folders it imports from (an editable
    checkout, PYTHONPATH)."""
    import matrixpool
    import matrixpool_recovery

    folders = {sys.prefix, sys.base_prefix}
    for module in (matrixpool, matrixpool_recovery):
        folders.add(str(Path(module.__file__ or ".").resolve().parent.parent))
    folders |= {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return sorted(folders)


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _now() -> str:
    return clock.SYSTEM.now().strftime("%Y-%m-%dT%H:%M:%SZ")


def _daemon_down(node: Any) -> bool:
    return (node.metadata.annotations or {}).get(faults.DAEMON_FAULT_ANNOTATION) == "down"


def _ready(node: Any) -> bool:
    conditions = (node.status.conditions or []) if node.status else []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _script(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else name


def _spawn(
    args: Iterable[str], log: Path, env: Mapping[str, str] | None = None, inherit: bool = True
) -> Process:
    """A child that dies with the sim, however the sim ends (no daemon outlives it). A
    container's process (``inherit`` False) gets exactly ``env`` and a process group of its
    own (:attr:`Process.group`); a daemon the sim's environment too."""
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            list(args),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**(os.environ if inherit else {}), **(env or {})},
            preexec_fn=cluster._die_with_parent,
            process_group=None if inherit else 0,
        )
    return Process(popen, log, group=not inherit)
