"""Job networking and a power cut on real nodes (issue 30, items 1, 2 and 5): pods on different
real nodes find each other as ``<hostname>.<service>.<ns>.svc.cluster.local`` through the
kubelet's cluster DNS (kube-dns → CoreDNS, carried by each node's kube-proxy), a ClusterIP
Service is reachable through kube-proxy, and ``cluster fault power-off``/``power-on`` takes a
node down as a machine that lost power (its agents, its containers, its memory, its address)
and boots it again. Nothing is exec'd in a pod: each one says what it saw in its termination
message."""

from __future__ import annotations

import datetime
import json
import secrets
import socket
from pathlib import Path
from typing import Any

from matrixpool.devcluster import dns, realnodes
from tests.integration import framework
from tests.realnodes.conftest import REAL_NODES, running

MEMORY = "/dev/shm/matrixpool"  # the node's tier-1 folder (tmpfs), as the chart mounts it
KUBELET_PORT = 10250


def pod(name: str, node: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [
                {"name": "main", "image": image, "imagePullPolicy": "Never", "command": command}
            ],
            **spec,
        },
    }


def apply(cluster: framework.TestCluster, namespace: str, *objects: dict[str, Any]) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=body)


def pods_of(cluster: framework.TestCluster, namespace: str) -> dict[str, dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout
    return {p["metadata"]["name"]: p for p in json.loads(out)["items"]}


def said(cluster: framework.TestCluster, namespace: str, names: list[str]) -> dict[str, str]:
    """Each pod's termination message, once every one of ``names`` has ended."""

    def ended() -> dict[str, str] | None:
        found = pods_of(cluster, namespace)
        messages = {}
        for name in names:
            statuses = (found.get(name) or {}).get("status", {}).get("containerStatuses") or []
            terminated = statuses[0].get("state", {}).get("terminated") if statuses else None
            if terminated is None:
                return None
            messages[name] = terminated.get("message", "")
        return messages

    return framework.eventually(ended, timeout=180, what=f"{names} ended")


def test_pods_on_real_nodes_resolve_each_other_and_reach_a_cluster_ip(
    cluster: framework.TestCluster, image: str, namespace: str
) -> None:
    ring = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "ring"},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app": "ring"},
            "ports": [{"name": "rendezvous", "port": 29500}],
        },
    }
    fqdn = "{peer}.ring." + namespace + ".svc.cluster.local"
    members = []
    for rank in (0, 1):
        peer = f"ring-{1 - rank}"
        name = fqdn.format(peer=peer)
        wait = f"for _ in $(seq 150); do getent hosts {name} && break; sleep 0.2; done"
        report = f"getent hosts {peer}.ring; cat /etc/resolv.conf"
        # A pod that ended leaves the EndpointSlice: each member stays until the test has read
        # the slice and started the "release" member, whose name it then resolves.
        release = "for _ in $(seq 600); do getent hosts release.ring && break; sleep 0.2; done"
        members.append(
            pod(
                f"ring-{rank}",
                f"real-{rank}",
                image,
                [
                    "sh",
                    "-c",
                    f"{wait} >/dev/null; ({report}) > /dev/termination-log; {release} >/dev/null",
                ],
                labels={"app": "ring"},
                hostname=f"ring-{rank}",
                subdomain="ring",
            )
        )
    echo = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "echo"},
        "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    server = pod(
        "echo-server",
        "real-1",
        image,
        ["python3", "-c", ECHO_SERVER],
        labels={"app": "echo"},
        restartPolicy="Always",
    )
    server["spec"]["containers"][0]["readinessProbe"] = {
        "tcpSocket": {"port": 8080},
        "periodSeconds": 1,
    }
    client = pod("echo-client", "real-0", image, ["python3", "-c", ECHO_CLIENT])
    apply(cluster, namespace, ring, echo, *members, server, client)

    # The endpointslice controller publishes the ring with each pod's hostname (routable
    # addresses: this is where CoreDNS's kubernetes plugin reads the names the pods resolve).
    def published() -> dict[str, str] | None:
        out = cluster.kubectl(
            "get", "endpointslices", "-n", namespace,
            "-l", "kubernetes.io/service-name=ring", "-o", "json",
        )  # fmt: skip
        named = {
            e["hostname"]: e["addresses"][0]
            for s in json.loads(out.stdout)["items"]
            for e in s.get("endpoints") or []
        }
        return named if len(named) == 2 else None

    named = framework.eventually(published, timeout=180, what="both ring pods in the slice")
    found = pods_of(cluster, namespace)
    assert named == {f"ring-{r}": found[f"ring-{r}"]["status"]["podIP"] for r in (0, 1)}
    releaser = pod(
        "release",
        "real-1",
        image,
        ["sleep", "120"],
        labels={"app": "ring"},
        hostname="release",
        subdomain="ring",
    )
    apply(cluster, namespace, releaser)

    messages = said(cluster, namespace, ["ring-0", "ring-1", "echo-client"])
    found = pods_of(cluster, namespace)
    for rank in (0, 1):
        peer = f"ring-{1 - rank}"
        lines = messages[f"ring-{rank}"].splitlines()
        assert lines[0].split() == [found[peer]["status"]["podIP"], fqdn.format(peer=peer)]
        assert lines[1:] == [  # as the kubelet asked containerd to write it
            f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local",
            f"nameserver {dns.SERVICE_IP}",
            "options ndots:5",
        ]
        assert found[f"ring-{rank}"]["status"]["podIP"].startswith("10.")  # the node's pod range
    cluster_ip = json.loads(
        cluster.kubectl("get", "service", "echo", "-n", namespace, "-o", "json").stdout
    )["spec"]["clusterIP"]
    assert messages["echo-client"] == f"{cluster_ip} served by echo-server"


ECHO_SERVER = """
import http.server, socket
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(("served by " + socket.gethostname()).encode())
http.server.HTTPServer(("0.0.0.0", 8080), Echo).serve_forever()
"""
ECHO_CLIENT = """
import socket, time, urllib.request
body = "unanswered"
for _ in range(120):
    try:
        body = urllib.request.urlopen("http://echo/", timeout=2).read().decode()
        break
    except OSError as error:
        body = repr(error)
        time.sleep(0.5)
open("/dev/termination-log", "w").write(socket.gethostbyname("echo") + " " + body)
"""


def answers(address: str, port: int) -> bool:
    """Whether a TCP connection to the node's address is accepted (its kubelet's port)."""
    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def lease_age(cluster: framework.TestCluster, node: str) -> tuple[float, int]:
    out = cluster.kubectl("get", "lease", node, "-n", "kube-node-lease", "-o", "json").stdout
    spec = json.loads(out)["spec"]
    renewed = datetime.datetime.fromisoformat(spec["renewTime"].replace("Z", "+00:00"))
    age = datetime.datetime.now(datetime.UTC) - renewed
    return age.total_seconds(), int(spec["leaseDurationSeconds"])


def ready(cluster: framework.TestCluster, node: str) -> str:
    out = cluster.kubectl("get", "node", node, "-o", "json").stdout
    conditions = json.loads(out)["status"]["conditions"]
    return str(next(c["status"] for c in conditions if c["type"] == "Ready"))


def memory_folder(cluster: framework.TestCluster, node: str) -> list[str]:
    """What the node itself sees in its memory folder (its mount namespace)."""
    listed = cluster.local.run_on_real_node(node, "find", MEMORY, "-mindepth", "1")
    assert listed.returncode == 0, listed.stderr
    return sorted(listed.stdout.split())


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by this process, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            if marker.encode() in cmdline and alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_power_off_stops_a_real_node_whole_and_power_on_boots_it_with_empty_memory(
    installed: framework.TestCluster, image: str, namespace: str
) -> None:
    cluster = installed
    operator_node = running(cluster, "operator")[0]["spec"]["nodeName"]
    node = next(f"real-{i}" for i in range(REAL_NODES) if f"real-{i}" != operator_node)
    daemon_before = next(
        d for d in running(cluster, "checkpoint-daemon") if d["spec"]["nodeName"] == node
    )
    restarts_before = daemon_before["status"]["containerStatuses"][0]["restartCount"]
    marker = f"3599.{secrets.randbelow(10**6):06d}"  # the sleep of our container, found by it
    shard = f"step-7-{marker}"
    holder = pod(
        "memory-holder",
        node,
        image,
        ["sh", "-c", f"echo 7 > /memory/{shard} && exec sleep {marker}"],
        securityContext={"runAsUser": 0},
        volumes=[{"name": "memory", "hostPath": {"path": MEMORY, "type": "Directory"}}],
    )
    holder["spec"]["containers"][0]["volumeMounts"] = [{"name": "memory", "mountPath": "/memory"}]
    apply(cluster, namespace, holder)
    # The shell's own command line holds the marker before it writes the shard: wait for both.
    framework.eventually(lambda: processes_with(marker), timeout=60, what="the holder's sleep")
    framework.eventually(
        lambda: shard in [Path(p).name for p in memory_folder(cluster, node)],
        timeout=30,
        what="the holder's shard in the node's memory folder",
    )
    facts = json.loads(Path(cluster.local.state_file).read_text())["real"]["nodes"][node]
    agents = {name: int(pid) for name, pid in facts["pids"].items()}
    assert set(agents) == {"containerd", "kubelet", "kube-proxy"}
    address = facts["ip"]
    assert answers(address, KUBELET_PORT)

    cluster.matrixpool("cluster", "fault", "power-off", node)

    assert not [name for name, pid in agents.items() if alive(pid)]
    assert processes_with(marker) == []  # the container died with the node
    socket_path = realnodes.Node(facts["index"], cluster.local.folder / "real" / node).socket
    assert processes_with(str(socket_path)) == []  # no shim of its containerd is left
    assert not answers(address, KUBELET_PORT)  # its address is down

    def stale() -> bool:
        age, duration = lease_age(cluster, node)
        return age > duration

    framework.eventually(stale, timeout=60, what=f"{node}'s Lease stale")
    framework.eventually(
        lambda: ready(cluster, node) != "True", timeout=120, what=f"{node} NotReady"
    )

    cluster.matrixpool("cluster", "fault", "power-on", node)

    assert ready(cluster, node) == "True"
    assert shard not in [Path(p).name for p in memory_folder(cluster, node)]  # tier 1 is gone
    assert not stale()  # renewed by the kubelet again
    assert answers(address, KUBELET_PORT)

    def daemon_back() -> dict[str, Any] | None:
        """The node's daemon pod running again once its kubelet reported the restart (right
        after the boot the pod may still show its status from before the power cut)."""
        on_node = [
            d
            for d in running(cluster, "checkpoint-daemon")
            if d["spec"]["nodeName"] == node
            and d["status"]["containerStatuses"][0]["restartCount"] > restarts_before
        ]
        return on_node[0] if on_node else None

    daemon_after = framework.eventually(daemon_back, timeout=180, what=f"{node}'s daemon back")
    assert daemon_after["metadata"]["uid"] == daemon_before["metadata"]["uid"]  # same pod, rebooted
    framework.eventually(
        lambda: len(running(cluster, "checkpoint-daemon")) == REAL_NODES,
        timeout=180,
        what="a daemon on every real node again",
    )
