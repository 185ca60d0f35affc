"""Cluster DNS of the local cluster (issue 30, item 1): CoreDNS with its kubernetes plugin
against the real API server, the kube-dns Service a real cluster has, records for the pods of a
headless Service (``<hostname>.<service>.<ns>.svc.cluster.local``) both from EndpointSlices
(the real nodes' path) and for kwok's loopback pods, and a pod run by ``matrixpool sim``'s
process kubelet that resolves its peer by name with getent, through the resolv.conf and
/etc/hosts a kubelet writes."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.devcluster import dns
from tests.integration import framework

SERVICE = "ring"
# Never contacted: the answer to a question is compared, no packet goes there (TEST-NET-2).
FAR_ADDRESS = "198.51.100.7"


def cluster_dns(cluster: framework.TestCluster) -> tuple[str, int]:
    out = cluster.kubectl("get", "service", "kube-dns", "-n", "kube-system", "-o", "json")
    found = dns.published_address(json.loads(out.stdout))
    assert found is not None, out.stdout
    return found


def ask(cluster: framework.TestCluster, name: str) -> list[str]:
    address, port = cluster_dns(cluster)
    return dns.lookup(name, address, port)[1]


def headless(name: str, selector: dict[str, str] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"clusterIP": "None", "publishNotReadyAddresses": True}
    spec["ports"] = [{"name": "rendezvous", "port": 29500}]
    if selector:
        spec["selector"] = selector
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}


def member(name: str, node: str, image: str, command: list[str]) -> dict[str, Any]:
    """A pod of the ring: hostname <name>, subdomain ring, bound to ``node``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": SERVICE}},
        "spec": {
            "hostname": name,
            "subdomain": SERVICE,
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": image, "command": command}],
        },
    }


def apply(cluster: framework.TestCluster, namespace: str, *objects: dict[str, Any]) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=body)


def pod_ips(cluster: framework.TestCluster, namespace: str, names: list[str]) -> dict[str, str]:
    def found() -> dict[str, str] | None:
        out = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout
        ips = {
            p["metadata"]["name"]: p["status"].get("podIP", "")
            for p in json.loads(out)["items"]
            if p["metadata"]["name"] in names
        }
        return ips if len(ips) == len(names) and all(ips.values()) else None

    return framework.eventually(found, timeout=60, what=f"addresses of {names}")


def test_the_cluster_has_kube_dns_and_coredns_answers_for_services(
    cluster: framework.TestCluster,
) -> None:
    out = cluster.kubectl("get", "service", "kube-dns", "-n", "kube-system", "-o", "json")
    service = json.loads(out.stdout)
    assert service["spec"]["clusterIP"] == dns.SERVICE_IP
    assert {(p["name"], p["protocol"], p["port"]) for p in service["spec"]["ports"]} == {
        ("dns", "UDP", 53),
        ("dns-tcp", "TCP", 53),
    }
    address, port = cluster_dns(cluster)
    assert address.startswith("127.53.")
    assert port == 53  # CI runs as root
    assert ask(cluster, "kubernetes.default.svc.cluster.local") == ["10.96.0.1"]
    assert ask(cluster, "kube-dns.kube-system.svc.cluster.local") == [dns.SERVICE_IP]
    code, none = dns.lookup("nothing.default.svc.cluster.local", address, port)
    assert (code, none) == (3, [])  # NXDOMAIN, authoritatively


def test_headless_pods_get_their_names_from_endpoint_slices_and_on_loopback(
    cluster: framework.TestCluster, namespace: str
) -> None:
    """Two kwok pods (loopback addresses, which no EndpointSlice may hold) and one endpoint
    published by hand with a routable address, as a real node's pod would be."""
    nodes = ["sn-0-node-00", "sn-0-node-01"]
    pods = [member(f"{SERVICE}-{i}", nodes[i], "example.invalid/workload:1", ["x"]) for i in (0, 1)]
    far_slice = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "far-1", "labels": {"kubernetes.io/service-name": "far"}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [FAR_ADDRESS], "hostname": "far-0", "conditions": {"ready": True}}
        ],
        "ports": [{"name": "rendezvous", "port": 29500, "protocol": "TCP"}],
    }
    apply(cluster, namespace, headless(SERVICE, {"app": SERVICE}), headless("far", None))
    apply(cluster, namespace, *pods, far_slice)
    ips = pod_ips(cluster, namespace, [f"{SERVICE}-0", f"{SERVICE}-1"])
    assert all(ip.startswith("127.200.") for ip in ips.values()), ips

    zone = f"{SERVICE}.{namespace}.svc.cluster.local"
    for name, ip in ips.items():
        fqdn = f"{name}.{zone}"
        framework.eventually(
            functools.partial(ask, cluster, fqdn), timeout=30, what=f"{fqdn} answered"
        )
        assert ask(cluster, fqdn) == [ip]
    assert ask(cluster, zone) == sorted(ips.values())
    far = framework.eventually(
        lambda: ask(cluster, f"far-0.far.{namespace}.svc.cluster.local"),
        timeout=30,
        what="far-0 from its EndpointSlice",
    )
    assert far == [FAR_ADDRESS]

    # The endpointslice controller runs: it made the ring's slice (empty: the API refuses
    # loopback addresses in it, which is why loopback pods get their names elsewhere).
    def controllers_slice() -> list[dict[str, Any]] | None:
        out = cluster.kubectl(
            "get", "endpointslices", "-n", namespace,
            "-l", f"kubernetes.io/service-name={SERVICE}", "-o", "json",
        )  # fmt: skip
        items = json.loads(out.stdout)["items"]
        return items or None

    [made] = framework.eventually(controllers_slice, timeout=30, what="the ring's EndpointSlice")
    managed = made["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
    assert managed == "endpointslice-controller.k8s.io"

    cluster.kubectl("delete", "pod", f"{SERVICE}-1", "-n", namespace, "--wait=false")
    framework.eventually(
        lambda: ask(cluster, zone) == [ips[f"{SERVICE}-0"]], timeout=30, what="ring-1 forgotten"
    )


@pytest.fixture
def sim(cluster: framework.TestCluster, tmp_path: Path) -> Iterator[framework.Sim]:
    """``matrixpool sim`` as the process kubelet of sn-0 (no daemons of its own)."""
    process = framework.Sim(cluster, tmp_path / "sim", ("sn-0",), daemons="chart").start()
    try:
        yield process
    finally:
        process.stop()
        print(process.log()[-5000:])


def test_a_pod_run_by_the_sim_resolves_its_peer_as_on_a_real_node(
    cluster: framework.TestCluster, namespace: str, sim: framework.Sim
) -> None:
    """Each pod waits (bounded) until its peer's name resolves, then prints what getent,
    hostname and its resolv.conf and /etc/hosts say; the sim's log of it is compared."""
    script = (
        'peer="$1"; for _ in $(seq 100); do getent hosts "$peer.ring" >/dev/null && break; '
        "sleep 0.2; done; "
        'echo "peer $(getent hosts "$peer.ring")"; '
        'echo "fqdn $(getent hosts "$peer.ring.$NS.svc.cluster.local")"; '
        'echo "hostname $(hostname) $HOSTNAME"; cat /etc/resolv.conf /etc/hosts'
    )
    pods = []
    for i, node in enumerate(["sn-0-node-02", "sn-0-node-03"]):
        command = ["sh", "-c", script, "sh", f"{SERVICE}-{1 - i}"]
        pod = member(f"{SERVICE}-{i}", node, "matrixpool:dev", command)
        pod["spec"]["containers"][0]["env"] = [{"name": "NS", "value": namespace}]
        pods.append(pod)
    apply(cluster, namespace, headless(SERVICE, {"app": SERVICE}), *pods)
    ips = pod_ips(cluster, namespace, [f"{SERVICE}-0", f"{SERVICE}-1"])

    def phases() -> dict[str, str] | None:
        out = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout
        found = {p["metadata"]["name"]: p["status"]["phase"] for p in json.loads(out)["items"]}
        return found if set(found.values()) <= {"Succeeded", "Failed"} else None

    assert framework.eventually(phases, timeout=90, what="both pods ended") == {
        f"{SERVICE}-0": "Succeeded",
        f"{SERVICE}-1": "Succeeded",
    }
    address, _ = cluster_dns(cluster)
    for i, node in enumerate(["sn-0-node-02", "sn-0-node-03"]):
        name, peer = f"{SERVICE}-{i}", f"{SERVICE}-{1 - i}"
        log = sim.folder / "trainers" / f"{node}.{namespace}.{name}.log"
        lines = log.read_text().splitlines()
        said = {line.split()[0]: line.split()[1:] for line in lines if line.strip()}
        fqdn = f"{peer}.{SERVICE}.{namespace}.svc.cluster.local"
        assert said["peer"] == [ips[peer], fqdn], lines  # the short name, by the search path
        assert said["fqdn"] == [ips[peer], fqdn], lines
        assert said["hostname"] == [name, name]
        assert f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local" in lines
        assert f"nameserver {address}" in lines
        assert "options ndots:5" in lines
        own = f"{ips[name]}\t{name}.{SERVICE}.{namespace}.svc.cluster.local\t{name}"
        assert own in lines
        assert "# Kubernetes-managed hosts file." in lines
