"""Real nodes beside the kwok ones: a kubelet, a kube-proxy and a containerd per node, running
real containers with runc, each node in a network namespace of its own.

``matrixpool cluster up --real-nodes N`` makes them (:mod:`.cluster`); ``cluster down`` removes
every container, mount, namespace and address this module made; ``cluster fault power-off`` /
``power-on`` cut a node's power and boot it again (:func:`power_off_node`). Needs root.

Layout of one cluster's real nodes (``<tag>`` is short and derived from the cluster folder, so
two clusters on one machine never share a name or a subnet)::

    host netns   bridge mp<tag>  10.<x>.0.1/24   (the API server listens here too)
      ├─ veth mp<tag>h<i>  ⇄  netns mp<tag>n<i>: eth0 10.<x>.0.<10+i>/24, default via .0.1
      │                          containerd + kubelet of node real-<i>, which also share a
      │                          mount namespace of the node's own (see NODE_PATHS)
      │                          pods: bridge cni0 10.<x>.<1+i>.0/24 (CNI bridge, host-local)
      │                          kube-proxy (iptables mode): every ClusterIP Service, among
      │                          them kubernetes (→ the API server on 10.<x>.0.1, which
      │                          advertises that address) and kube-dns (10.96.0.10 → CoreDNS
      │                          on 10.<x>.0.1:53, the kubelet's clusterDNS)
      └─ routes in every node's netns to every other node's pod subnet, via that node's IP

What is not a kind node: images come only from ``matrixpool cluster load-image`` (no
registry), and every node sees the machine's whole CPU and memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from matrixpool.api import labels
from matrixpool.devcluster import dns, images

PAUSE_IMAGE = "matrixpool/pause:local"  # the CRI sandbox image, made from our own pause binary
CNI_BIN = Path("/usr/lib/cni")
NODE_PREFIX = "real-"
KUBE_PROXY_USER = "system:kube-proxy"  # bound to system:node-proxier by the API server itself
Progress = Callable[[str], None]


# Host folders each real node has of its own, as separate machines would: bound from the
# node's folder inside its mount namespace (``/var/lib/matrixpool/persistent``, tier 3, stays
# the host's: the shared file system every node mounts). tmpfs: a memory file system.
NODE_PATHS = (
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
    "/run/containerd",
    "/var/lib/matrixpool/checkpoints",
    "/dev/shm/matrixpool",
)
TMPFS_PATHS = ("/dev/shm/matrixpool",)
TMPFS_SIZE = "2g"
MOUNT_NAMESPACES = Path("/run/matrixpool")


class RealNodeError(RuntimeError):
    """A real node could not be started, reached or removed."""


@dataclass(frozen=True)
class Network:
    """Names and addresses of one cluster's node network (see the module docstring)."""

    tag: str  # 4 hex digits from the cluster folder
    octet: int  # the x of 10.x.0.0/16

    @classmethod
    def of(cls, folder: Path) -> Network:
        digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()
        return cls(tag=digest[:4], octet=100 + int(digest[4:8], 16) % 100)

    @property
    def bridge(self) -> str:
        return f"mp{self.tag}"

    @property
    def gateway(self) -> str:
        return f"10.{self.octet}.0.1"

    def namespace(self, index: int) -> str:
        return f"mp{self.tag}n{index}"

    def mount_namespace(self, index: int) -> Path:
        return MOUNT_NAMESPACES / self.tag / self.namespace(index)

    def host_veth(self, index: int) -> str:
        return f"mp{self.tag}h{index}"

    def node_ip(self, index: int) -> str:
        return f"10.{self.octet}.0.{10 + index}"

    def pod_subnet(self, index: int) -> str:
        return f"10.{self.octet}.{1 + index}.0/24"


@dataclass(frozen=True)
class Node:
    """One real node: its name, index and where its files live."""

    index: int
    folder: Path  # <cluster>/real/<name>

    @property
    def name(self) -> str:
        return f"{NODE_PREFIX}{self.index}"

    @property
    def socket(self) -> Path:
        return self.folder / "containerd" / "containerd.sock"


def node_names(count: int) -> list[str]:
    return [f"{NODE_PREFIX}{i}" for i in range(count)]


def node_labels(index: int, nodes_per_rack: int, supernode: str) -> dict[str, str]:
    """Labels of real node ``index``: its own supernode and racks, like the kwok nodes'."""
    return {
        labels.SUPERNODE: supernode,
        labels.RACK: f"{supernode}-rack-{index // nodes_per_rack}",
        "type": "real",
    }


# ---- configuration files (pure) ------------------------------------------------------------


def containerd_config(node: Node, root: Path | None = None) -> str:
    """containerd's config: its own root (``root``, else in the node's folder), state and
    sockets; CRI with our pause image, the overlayfs snapshotter and the node's CNI folder.
    ``restrict_oom_score_adj``: this machine forbids lowering a process's OOM score below its
    parent's (runc fails otherwise)."""
    base = node.folder / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join(
        [
            "version = 2",
            f'root = "{root or base / "root"}"',
            f'state = "{base / "state"}"',
            "[grpc]",
            f'  address = "{node.socket}"',
            "[ttrpc]",
            f'  address = "{node.socket}.ttrpc"',
            '[plugins."io.containerd.internal.v1.opt"]',
            f'  path = "{base / "opt"}"',
            f"[{cri}]",
            f'  sandbox_image = "{PAUSE_IMAGE}"',
            "  restrict_oom_score_adj = true",
            # Pods' network namespaces under the state folder, so `down` finds and removes them.
            "  netns_mounts_under_state_dir = true",
            "  enable_unprivileged_ports = true",
            f"[{cri}.containerd]",
            '  snapshotter = "overlayfs"',
            '  default_runtime_name = "runc"',
            f"[{cri}.containerd.runtimes.runc]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{cri}.cni]",
            f'  bin_dir = "{CNI_BIN}"',
            f'  conf_dir = "{node.folder / "cni" / "net.d"}"',
            "",
        ]
    )


def cni_config(node: Node, network: Network) -> dict[str, Any]:
    """A bridge network per node: pods get addresses from the node's own /24; traffic leaving
    the node is masqueraded to the node's IP (other nodes reach pods through their routes)."""
    return {
        "cniVersion": "1.0.0",
        "name": f"matrixpool-{node.name}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": network.pod_subnet(node.index)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.folder / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(node: Node, ca_cert: Path) -> dict[str, Any]:
    """The kubelet's configuration for this machine (cgroup v1, swap on, no QoS cgroups), with
    image GC off (a deleted image could not be pulled again, since no registry is reached) and
    the cluster DNS: pods ask the kube-dns Service, which kube-proxy carries to CoreDNS."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "failSwapOn": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_cert)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "resolvConf": "/etc/resolv.conf",
        "clusterDNS": [dns.SERVICE_IP],
        "clusterDomain": dns.DOMAIN,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
        },
        "serializeImagePulls": False,
        # A stopped kubelet shows in its Lease after 20 s (default 40): faster chaos drills.
        "nodeLeaseDurationSeconds": 20,
        "nodeStatusReportFrequency": "10s",
        "nodeStatusUpdateFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "volumePluginDir": "/var/lib/kubelet/volume-plugins",
    }


# ---- the network --------------------------------------------------------------------------


def _run(args: Iterable[str], *, check: bool = True, input: str | None = None) -> str:
    result = subprocess.run(list(args), capture_output=True, text=True, input=input, check=False)
    if check and result.returncode != 0:
        raise RealNodeError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def in_netns(namespace: str, *args: str) -> list[str]:
    """``args`` run in ``namespace``'s network only."""
    return ["nsenter", f"--net=/run/netns/{namespace}", "--", *args]


def in_node(network: Network, index: int, *args: str) -> list[str]:
    """``args`` run as on node ``index``: its network and its mount namespace."""
    return [
        "nsenter",
        f"--net=/run/netns/{network.namespace(index)}",
        f"--mount={network.mount_namespace(index)}",
        "--",
        *args,
    ]


def ensure_mount_namespace(network: Network, node: Node) -> None:
    """The node's persistent mount namespace (a file under /run/matrixpool bound to it), a
    slave of the host's, with the node's own NODE_PATHS. Safe to repeat."""
    holder = network.mount_namespace(node.index)
    if holder.exists() and _is_mount_point(holder):
        return
    parent = holder.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not _is_mount_point(parent):  # a namespace file must sit on a private mount
        _run(["mount", "--bind", str(parent), str(parent)])
        _run(["mount", "--make-private", str(parent)])
    holder.touch()
    _run(["unshare", f"--mount={holder}", "--propagation=slave", "true"])
    script = ["set -e"]
    for path in NODE_PATHS:
        Path(path).mkdir(parents=True, exist_ok=True)  # the mount point, empty on the host
        if path in TMPFS_PATHS:
            script.append(f"mount -t tmpfs -o size={TMPFS_SIZE},mode=1777 tmpfs {path}")
        else:
            own = node.folder / "host" / path.strip("/").replace("/", "-")
            own.mkdir(parents=True, exist_ok=True)
            script.append(f"mount --bind {own} {path}")
    _run(["nsenter", f"--mount={holder}", "--", "sh", "-c", "\n".join(script)])


def remove_mount_namespaces(network: Network) -> None:
    folder = MOUNT_NAMESPACES / network.tag
    if not folder.exists():
        return
    for holder in folder.iterdir():
        subprocess.run(["umount", "-l", str(holder)], capture_output=True, check=False)
        holder.unlink(missing_ok=True)
    subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)
    shutil.rmtree(folder, ignore_errors=True)


def _is_mount_point(path: Path) -> bool:
    target = str(path.resolve())
    return any(
        line.split()[4] == target for line in Path("/proc/self/mountinfo").read_text().splitlines()
    )


def ensure_bridge(network: Network) -> None:
    if _run(["ip", "-o", "link", "show", network.bridge], check=False):
        return
    _run(["ip", "link", "add", network.bridge, "type", "bridge"])
    _run(["ip", "addr", "add", f"{network.gateway}/24", "dev", network.bridge])
    _run(["ip", "link", "set", network.bridge, "up"])


def ensure_namespace(network: Network, index: int) -> None:
    """The node's network namespace, its veth to the bridge, its address and forwarding (the
    Services are kube-proxy's). Safe to repeat."""
    ns, veth = network.namespace(index), network.host_veth(index)
    if ns not in _run(["ip", "netns", "list"]).split():
        _run(["ip", "netns", "add", ns])
    if not _run(["ip", "-o", "link", "show", veth], check=False):
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
        _run(["ip", "link", "set", veth, "master", network.bridge, "up"])
        _run(["ip", "-n", ns, "addr", "add", f"{network.node_ip(index)}/24", "dev", "eth0"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    link_up(network, index)
    _run(in_netns(ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"))


def link_up(network: Network, index: int) -> None:
    """The node's eth0 up with its default route via the bridge (a link set down loses it)."""
    ns = network.namespace(index)
    _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
    _run(["ip", "-n", ns, "route", "replace", "default", "via", network.gateway])


def link_down(network: Network, index: int) -> None:
    """The node's eth0 down: its address answers nothing, its routes are gone."""
    _run(["ip", "-n", network.namespace(index), "link", "set", "eth0", "down"])


def ensure_routes(network: Network, count: int, off: Iterable[int] = ()) -> None:
    """Every node reaches every other node's pods through that node's IP; a node powered off
    (``off``: its link down, so no route can go through its namespace's gateway) gets its
    routes when it is powered on."""
    down = set(off)
    for i in range(count):
        if i in down:
            continue
        for j in range(count):
            if i != j:
                _run(
                    in_netns(
                        network.namespace(i),
                        "ip",
                        "route",
                        "replace",
                        network.pod_subnet(j),
                        "via",
                        network.node_ip(j),
                    )
                )


def remove_network(network: Network, count_hint: int = 64) -> None:
    """Delete every namespace and link of ``network`` (the veths go with their namespaces)."""
    for ns in _run(["ip", "netns", "list"], check=False).split():
        if ns.startswith(f"mp{network.tag}n"):
            _run(["ip", "netns", "delete", ns], check=False)
    for line in _run(["ip", "-o", "link", "show"], check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name == network.bridge or name.startswith(f"mp{network.tag}h"):
            _run(["ip", "link", "delete", name], check=False)


# ---- containers and mounts ----------------------------------------------------------------


def ctr(node: Node, *args: str, check: bool = True) -> str:
    return _run(["ctr", f"--address={node.socket}", "--namespace=k8s.io", *args], check=check)


def import_archive(node: Node, archive: Path) -> None:
    """Load a docker-archive into the node's containerd whole (the pause image)."""
    ctr(node, "images", "import", "--snapshotter=overlayfs", str(archive))


def import_image(node: Node, archive: Path) -> list[str]:
    """Load a docker-archive into the node's containerd, unpacked for the CRI's snapshotter,
    as an OCI layout that carries only the layers the node lacks (a node that kept its root
    between clusters holds the base and torch layers as snapshots). Once unpacked, the layers'
    blobs are dropped: the node runs containers from the snapshots, and the blobs were a
    second copy (3.3 GB of the 6.8 GB per node for the matrixpool image). Returns the layers
    written."""
    with tarfile.open(archive) as tar:
        manifest = tar.extractfile("manifest.json")
        [tag] = json.load(manifest)[0]["RepoTags"] if manifest else [""]
    layers = images.diff_ids(archive)
    have = set(ctr(node, "content", "ls", "--quiet").split())
    listed = ctr(node, "snapshots", "--snapshotter=overlayfs", "ls").splitlines()[1:]
    snapshots = {row.split()[0] for row in listed if row.split()[-1:] == ["Committed"]}
    have |= {d for d, c in zip(layers, images.chain_ids(layers), strict=True) if c in snapshots}
    argv = ["ctr", f"--address={node.socket}", "--namespace=k8s.io"]
    argv += ["images", "import", "--snapshotter=overlayfs", "-"]
    name = spelled(node, tag)
    with tempfile.TemporaryFile() as err:
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=err, stderr=err)
        assert process.stdin is not None
        written: list[str] = []
        try:
            with process.stdin:
                written = images.write_oci(archive, process.stdin, name, have)
        except BrokenPipeError:
            pass  # ctr stopped reading: its exit status and message say why
        if process.wait():
            err.seek(0)
            said = err.read().decode(errors="replace")[-2000:]
            raise RealNodeError(f"importing {archive} into {node.name}: {said}")
    held = set(ctr(node, "content", "ls", "--quiet").split())
    if dropped := [d for d in layers if d in held]:
        ctr(node, "content", "rm", *dropped)  # containerd's collector frees the files
    return written


def spelled(node: Node, name: str) -> str:
    """``name`` as the node's containerd and kubelet spell it: with the domain that
    containerd's own import of a docker-archive gave the pause image (cluster up loads it)."""
    names = ctr(node, "images", "ls", "--quiet").split()
    pause = [n for n in names if n.endswith("/" + PAUSE_IMAGE)]
    if not pause:
        raise RealNodeError(f"{node.name} holds no {PAUSE_IMAGE} image to learn names from")
    return images.full_name(name, pause[0].removesuffix("/" + PAUSE_IMAGE))


def remove_containers(node: Node) -> None:
    """Kill and delete every container of the node's containerd (its sandboxes too)."""
    if not node.socket.exists():
        return
    tasks = ctr(node, "tasks", "list", "--quiet", check=False).split()
    for task in tasks:
        ctr(node, "tasks", "kill", "--signal=SIGKILL", task, check=False)
    deadline = time.monotonic() + 10
    for task in tasks:
        while time.monotonic() < deadline:
            if ctr(node, "tasks", "delete", "--force", task, check=False) or task not in ctr(
                node, "tasks", "list", "--quiet", check=False
            ):
                break
            time.sleep(0.2)
    for container in ctr(node, "containers", "list", "--quiet", check=False).split():
        ctr(node, "containers", "delete", container, check=False)


def image_store(cache: Path, index: int) -> Path:
    """Where real node ``index``'s containerd keeps its root between clusters: its content
    store and unpacked layers, so that a warm run's image import writes only the layers that
    changed (the app layer) instead of the whole 3.45 GB image into every node."""
    return cache / "realnodes" / f"containerd-{index}"


def lock_store(store: Path) -> int | None:
    """Lock ``store`` for one containerd: an open descriptor holding an exclusive flock, to be
    handed to that containerd (which keeps it, with its shims, as long as they live), or None
    when another cluster's containerd holds it."""
    store.mkdir(parents=True, exist_ok=True)
    fd = os.open(store.with_name(store.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def remove_stale_containers(node: Node) -> bool:
    """Delete what a previous cluster left in a kept root (containers and sandboxes of pods
    that no longer exist, when it went down without its containerd, a node powered off);
    True if there were any: the CRI plugin loaded them at start and must start again."""
    if not ctr(node, "containers", "list", "--quiet", check=False).split():
        return False
    remove_containers(node)
    return True


def task_pids(node: Node) -> list[int]:
    """The first process of every container the node's containerd runs (sandboxes too)."""
    pids = []
    for line in ctr(node, "tasks", "list", check=False).splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and fields[1].isdigit() and int(fields[1]) > 0:
            pids.append(int(fields[1]))
    return pids


def kill_containers(first_pids: Iterable[int], timeout: float = 10) -> None:
    """SIGKILL every process of the containers whose first processes are ``first_pids``: all
    of each one's pid namespace (its children included; never this machine's own, which a
    ``hostPID`` container shares) and every descendant of its first process; until none is
    left."""
    first = set(first_pids)
    own = _pid_namespace(os.getpid())
    namespaces = {ns for pid in first if (ns := _pid_namespace(pid)) and ns != own}
    deadline = time.monotonic() + timeout
    while first or namespaces:
        parents = _parents()
        left = [
            p for p in parents if _pid_namespace(p) in namespaces or _descends(p, first, parents)
        ]
        if not left:
            return
        if time.monotonic() > deadline:
            raise RealNodeError(f"processes {left[:10]} outlived SIGKILL for {timeout:.0f} s")
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        time.sleep(0.1)


def _parents() -> dict[int, int]:
    """Every live process (zombies left out) → its parent."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            found[int(entry.name)] = int(fields[1])
    return found


def _descends(pid: int, ancestors: set[int], parents: dict[int, int]) -> bool:
    for _ in range(64):  # a process tree is never this deep here; a cycle cannot be
        if pid in ancestors:
            return True
        if pid not in parents or pid <= 1:
            return False
        pid = parents[pid]
    return False


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def mounts_in_node(network: Network, index: int) -> list[str]:
    """Every mount point of the node's mount namespace."""
    holder = str(network.mount_namespace(index))
    table = _run(["nsenter", f"--mount={holder}", "--", "cat", "/proc/self/mountinfo"])
    return [line.split()[4].replace("\\040", " ") for line in table.splitlines()]


def unmount_in_node(network: Network, index: int, prefixes: Iterable[str]) -> None:
    """Unmount, deepest first, what the node mounted at or below each of ``prefixes`` (its
    containerd's rootfs overlays and pod network namespaces, the kubelet's volumes)."""
    wanted = [p.rstrip("/") for p in prefixes]
    points = [
        m
        for m in mounts_in_node(network, index)
        if any(m == p or m.startswith(p + "/") for p in wanted)
    ]
    holder = str(network.mount_namespace(index))
    for point in sorted(set(points), key=len, reverse=True):
        subprocess.run(
            ["nsenter", f"--mount={holder}", "--", "umount", "-l", point],
            capture_output=True,
            check=False,
        )


def mount_memory(network: Network, index: int) -> None:
    """The node's memory file systems (TMPFS_PATHS), fresh and empty, as after a boot."""
    mounted = set(mounts_in_node(network, index))
    holder = str(network.mount_namespace(index))
    for path in TMPFS_PATHS:
        if path not in mounted:
            options = f"size={TMPFS_SIZE},mode=1777"
            _run(["nsenter", f"--mount={holder}", "--", "mount", "-t", "tmpfs", "-o", options,
                  "tmpfs", path])  # fmt: skip


def kill_shims(node: Node) -> None:
    """containerd's shims outlive containerd by design; ours are the ones naming our socket."""
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            cmdline = (pid_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            cmdline
            and cmdline[0].endswith(b"containerd-shim-runc-v2")
            and str(node.socket).encode() in cmdline
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_dir.name), 9)


def unmount_under(folder: Path) -> None:
    """Unmount everything mounted below ``folder`` (kubelet's volumes, containerd's rootfs
    overlays and shm), deepest first."""
    prefix = str(folder.resolve()) + "/"
    mounts = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point.startswith(prefix):
            mounts.append(point)
    for point in sorted(set(mounts), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


# ---- node processes ------------------------------------------------------------------------


SHARED_PERSISTENT = Path("/var/lib/matrixpool/persistent")  # the chart's persistentPath
DAEMON_UID = 65532  # the chart's securityContext.runAsUser / runAsGroup


def prepare_shared_persistent(path: Path = SHARED_PERSISTENT, uid: int = DAEMON_UID) -> None:
    """The shared file system every real node mounts as tier 3, as an administrator prepares
    it (charts/matrixpool/values.yaml: persistentPath is "writable by the daemon's user"): the
    folder exists and belongs to the chart's daemon user. Without it the daemons' tier-3
    writes fail with EACCES (a root-owned folder)."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_uid != uid:
        os.chown(path, uid, uid)
    path.chmod(0o755)


def prepare(
    node: Node,
    network: Network,
    *,
    server: str,
    pki: Any,
    client_cert: tuple[Path, Path],
    containerd_root: Path | None = None,
) -> None:
    """Write the node's containerd, CNI and kubelet files."""
    for sub in ("containerd", "cni/net.d", "cni/ipam", "kubelet"):
        (node.folder / sub).mkdir(parents=True, exist_ok=True)
    config = containerd_config(node, containerd_root)
    (node.folder / "containerd" / "config.toml").write_text(config)
    (node.folder / "cni" / "net.d" / "10-matrixpool.conflist").write_text(
        json.dumps(cni_config(node, network), indent=2)
    )
    (node.folder / "kubelet" / "config.yaml").write_text(
        yaml.safe_dump(kubelet_config(node, pki.ca_cert), sort_keys=False)
    )
    cert, key = client_cert
    kubeconfig = client_kubeconfig(server, pki.ca_cert, cert, key, node.name)
    (node.folder / "kubelet" / "kubeconfig").write_text(yaml.safe_dump(kubeconfig, sort_keys=False))


def client_kubeconfig(
    server: str, ca_cert: Path, cert: Path, key: Path, user: str
) -> dict[str, Any]:
    """A kubeconfig for one client certificate (a node's kubelet or kube-proxy, CoreDNS)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}
        ],
        "users": [
            {"name": user, "user": {"client-certificate": str(cert), "client-key": str(key)}}
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }


def kube_proxy_config(node: Node, network: Network) -> dict[str, Any]:
    """kube-proxy in iptables mode for one node: its pods' range is the cluster's (traffic from
    outside it is masqueraded), NodePorts on the node's own address, conntrack left as the
    machine has it (its limits are the host's, not a namespace's)."""
    folder = node.folder / "kube-proxy"
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(folder / "kubeconfig")},
        "hostnameOverride": node.name,
        "mode": "iptables",
        "clusterCIDR": f"10.{network.octet}.0.0/16",
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{network.node_ip(node.index)}/32"],
        "conntrack": {"maxPerCore": 0, "min": 0},
        "iptables": {"syncPeriod": "10s", "minSyncPeriod": "1s"},
    }


def prepare_kube_proxy(
    node: Node, network: Network, *, server: str, ca_cert: Path, client_cert: tuple[Path, Path]
) -> None:
    folder = node.folder / "kube-proxy"
    folder.mkdir(parents=True, exist_ok=True)
    config = client_kubeconfig(server, ca_cert, *client_cert, KUBE_PROXY_USER)
    (folder / "kubeconfig").write_text(yaml.safe_dump(config, sort_keys=False))
    (folder / "config.yaml").write_text(
        yaml.safe_dump(kube_proxy_config(node, network), sort_keys=False)
    )


def kube_proxy_args(node: Node, network: Network, bin_dir: Path) -> list[str]:
    config = node.folder / "kube-proxy" / "config.yaml"
    return in_node(network, node.index, str(bin_dir / "kube-proxy"), f"--config={config}", "--v=1")


def wait_kube_proxy(
    network: Network, index: int, services: Iterable[str], timeout: float = 60
) -> None:
    """Until kube-proxy's rules in the node carry each of ``services`` ("<ns>/<name>:<port>",
    as its rules' comments name them)."""
    deadline = time.monotonic() + timeout
    missing = set(services)
    while missing:
        rules = _run(in_netns(network.namespace(index), "iptables-save", "-t", "nat"), check=False)
        missing = {s for s in missing if f'"{s} cluster IP"' not in rules}
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RealNodeError(
                f"kube-proxy of node {index} has no rules for {', '.join(sorted(missing))} "
                f"after {timeout:.0f} s (see real/<node>/kube-proxy.log)"
            )
        time.sleep(0.5)


def containerd_args(node: Node, network: Network) -> list[str]:
    return in_node(
        network,
        node.index,
        "containerd",
        f"--config={node.folder / 'containerd' / 'config.toml'}",
        "--log-level=warn",
    )


def kubelet_args(
    node: Node, network: Network, bin_dir: Path, node_labels: dict[str, str]
) -> list[str]:
    kubelet_dir = node.folder / "kubelet"
    return in_node(
        network,
        node.index,
        str(bin_dir / "kubelet"),
        f"--config={kubelet_dir / 'config.yaml'}",
        f"--kubeconfig={kubelet_dir / 'kubeconfig'}",
        "--root-dir=/var/lib/kubelet",
        f"--hostname-override={node.name}",
        f"--node-ip={network.node_ip(node.index)}",
        f"--node-labels={','.join(f'{k}={v}' for k, v in sorted(node_labels.items()))}",
        "--v=1",
    )


def wait_containerd(node: Node, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            node.socket.exists()
            and subprocess.run(
                ["ctr", f"--address={node.socket}", "version"], capture_output=True, check=False
            ).returncode
            == 0
        ):
            return
        time.sleep(0.2)
    raise RealNodeError(
        f"containerd of {node.name} did not answer on {node.socket} in {timeout:.0f} s"
    )


def pause_archive(bin_dir: Path, out: Path) -> Path:
    """A docker-archive of the pause binary, as the CRI sandbox image."""
    if not out.exists():
        images.write_archive(
            out,
            PAUSE_IMAGE,
            layers=[images.layer_of_files({"pause": bin_dir / "pause"})],
            config={"Entrypoint": ["/pause"], "User": "65535:65535"},
        )
    return out


def is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def require_root() -> None:
    if os.geteuid() != 0:
        raise RealNodeError("real nodes need root (network namespaces, containerd, runc)")


def require_tools() -> None:
    """What the real nodes run, once tools/k8s/node-packages.sh installed it."""
    for tool in ("nsenter", "ip", "iptables", "iptables-save", "iptables-restore", "containerd",
                 "ctr", "runc"):  # fmt: skip
        if shutil.which(tool) is None:
            raise RealNodeError(f"{tool} not found: run tools/k8s/node-packages.sh (as root)")
