"""The local cluster's DNS, as a real cluster has it: CoreDNS (built by tools/k8s/build.sh at
``COREDNS_VERSION``) with its kubernetes plugin reading our API server, zone ``cluster.local``,
and a ``kube-dns`` Service in ``kube-system`` (ClusterIP 10.96.0.10).

What ``cluster up`` writes (the Corefile, the objects it applies), where a cluster's CoreDNS
listens, and :func:`lookup`, a resolver's question over UDP (``cluster up`` waits with it until
CoreDNS answers; the tests ask with it). Called by :mod:`.cluster` (starts CoreDNS),
:mod:`.realnodes` (the kubelets' ``clusterDNS``), :mod:`.sim` (finds the address for its pods'
resolv.conf) and :mod:`.loopbackdns` (writes the records of loopback pods).

Where CoreDNS listens, always on port 53 (glibc's resolver asks no other port)::

    127.53.<a>.<b>  a loopback address of the cluster's own, <a>.<b> from its folder's hash: clear
                    of the kwok nodes' 127.1-3.*.*, kwok's pod range 127.200/16 and 127.0.0.1.
                    This machine's processes and the pods ``matrixpool sim`` runs ask here.
    10.<x>.0.1      with real nodes, their bridge's gateway (:class:`.realnodes.Network`): the
                    kube-dns Service's endpoint, to which each node's kube-proxy carries
                    10.96.0.10, the nameserver its kubelet gives pods.

The loopback address is published on the kube-dns Service (:data:`ADDRESS_ANNOTATION`), so a
process that knows only the kubeconfig (``matrixpool sim``) finds it.

Loopback pods: the pods of kwok nodes have loopback addresses (kwok's 127.200.0.0/16; the sim's
processes serve on them). The API refuses loopback addresses in an EndpointSlice ("may not be
in the loopback range"), so the endpointslice controller cannot publish those pods and the
kubernetes plugin never sees them; :mod:`.loopbackdns` writes what it would answer for them to a
hosts file that CoreDNS's hosts plugin serves ahead of the kubernetes plugin.
"""

from __future__ import annotations

import hashlib
import secrets
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matrixpool.api import labels

DOMAIN = labels.CLUSTER_DOMAIN
SERVICE_IP = "10.96.0.10"  # kube-dns's ClusterIP, as kubeadm picks it (10th of SERVICE_CIDR)
PORT = 53
USER = "system:coredns"  # CoreDNS's client certificate; RBAC as kubeadm grants it
ADDRESS_ANNOTATION = "matrixpool.dev/dns-address"  # on kube-dns: "<loopback address>:<port>"
TTL = 5  # seconds, of every answer (the kubernetes plugin's default)


@dataclass(frozen=True)
class Server:
    """Where one cluster's CoreDNS listens and what it reads."""

    addresses: tuple[str, ...]  # bound on PORT; the first is the cluster's loopback address
    kubeconfig: Path  # CoreDNS's own credentials for the API server
    records: Path  # the hosts file of loopback pods (:mod:`.loopbackdns`)
    health_port: int  # /health on 127.0.0.1
    ready_port: int  # /ready on 127.0.0.1: 200 once the kubernetes plugin has synced
    port: int = PORT
    upstream: str = "/etc/resolv.conf"  # names outside the cluster go where this machine's go


def loopback_address(folder: Path) -> str:
    """The cluster's own loopback address, 127.53.<a>.<b>, from its folder."""
    digest = hashlib.sha256(str(folder.resolve()).encode()).digest()
    return f"127.53.{digest[0]}.{1 + digest[1] % 254}"


def corefile(server: Server, domain: str = DOMAIN) -> str:
    """The Corefile: kubeadm's (errors, health, ready, kubernetes, forward, loadbalance) with a
    bind, the hosts plugin for loopback pods, and no cache, so that a name resolves as soon as
    its pod has an address (a short-lived test cluster asks again often; answers come from
    memory). No loop plugin: its startup probe would go to the upstream resolver."""
    return "\n".join(
        [
            f".:{server.port} {{",
            f"    bind {' '.join(server.addresses)}",
            "    errors",
            f"    health 127.0.0.1:{server.health_port}",
            f"    ready 127.0.0.1:{server.ready_port}",
            f"    hosts {server.records} {domain} {{",
            f"        ttl {TTL}",
            "        reload 1s",
            "        fallthrough",
            "    }",
            f"    kubernetes {domain} in-addr.arpa ip6.arpa {{",
            f"        kubeconfig {server.kubeconfig}",
            "        pods insecure",
            "        fallthrough in-addr.arpa ip6.arpa",
            f"        ttl {TTL}",
            "    }",
            f"    forward . {server.upstream}",
            "    loadbalance",
            "}",
            "",
        ]
    )


def rbac() -> list[dict[str, Any]]:
    """ClusterRole ``system:coredns`` as kubeadm writes it, bound to CoreDNS's user."""
    read = ["list", "watch"]
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": read,
                },
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:coredns",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": USER}],
        },
    ]


def service(loopback: str, port: int = PORT) -> dict[str, Any]:
    """``kube-system/kube-dns`` as a real cluster names it. No selector: CoreDNS is no pod here;
    its endpoint (real nodes only) is :func:`endpoint_slice`."""
    ports = [
        {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": port},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": port},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "kube-dns",
            "namespace": "kube-system",
            "labels": {
                "k8s-app": "kube-dns",
                "kubernetes.io/cluster-service": "true",
                "kubernetes.io/name": "CoreDNS",
            },
            "annotations": {ADDRESS_ANNOTATION: f"{loopback}:{port}"},
        },
        "spec": {"clusterIP": SERVICE_IP, "ports": ports},
    }


def endpoint_slice(address: str, port: int = PORT) -> dict[str, Any]:
    """kube-dns's endpoint: CoreDNS on the real nodes' gateway (a loopback address would be
    refused), for their kube-proxy."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "kube-dns-local",
            "namespace": "kube-system",
            "labels": {
                "kubernetes.io/service-name": "kube-dns",
                "endpointslice.kubernetes.io/managed-by": "devcluster.matrixpool.dev",
            },
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": [
            {"name": "dns", "port": port, "protocol": "UDP"},
            {"name": "dns-tcp", "port": port, "protocol": "TCP"},
        ],
    }


def published_address(kube_dns: dict[str, Any] | None) -> tuple[str, int] | None:
    """The loopback address and port a kube-dns Service (a dict, as the API returns it)
    publishes; None when it names none (a cluster not made by ``cluster up``)."""
    annotations = ((kube_dns or {}).get("metadata") or {}).get("annotations") or {}
    host, _, port = str(annotations.get(ADDRESS_ANNOTATION, "")).rpartition(":")
    if not host or not port.isdigit():
        return None
    return host, int(port)


def lookup(name: str, server: str, port: int = PORT, timeout: float = 2.0) -> tuple[int, list[str]]:
    """Ask ``server`` for the A records of ``name`` (one UDP question, as glibc asks it): the
    response code (0 NOERROR, 3 NXDOMAIN) and the addresses, sorted."""
    ident = secrets.randbelow(1 << 16)
    labels_ = [part.encode() for part in name.rstrip(".").split(".")]
    question = b"".join(bytes([len(p)]) + p for p in labels_) + b"\0" + struct.pack(">HH", 1, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        sock.sendto(struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question, (server, port))
        data = sock.recv(4096)
        while struct.unpack(">H", data[:2])[0] != ident:  # a late answer to another question
            data = sock.recv(4096)
    answers = struct.unpack(">H", data[6:8])[0]
    offset = _skip_name(data, 12) + 4  # the question echoed
    addresses = []
    for _ in range(answers):
        offset = _skip_name(data, offset)
        kind, _, _, length = struct.unpack(">HHIH", data[offset : offset + 10])
        offset += 10
        if kind == 1:  # A
            addresses.append(socket.inet_ntoa(data[offset : offset + length]))
        offset += length
    return data[3] & 0x0F, sorted(addresses)


def _skip_name(data: bytes, offset: int) -> int:
    """The offset after the (possibly compressed) name at ``offset``."""
    while data[offset]:
        if data[offset] & 0xC0 == 0xC0:
            return offset + 2
        offset += data[offset] + 1
    return offset + 1
