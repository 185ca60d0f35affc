"""The local cluster's DNS without starting it: the Corefile and objects ``cluster up`` writes
(matrixpool.devcluster.dns), the records of loopback pods (devcluster.loopbackdns), what the
process kubelet writes as a pod's resolv.conf, /etc/hosts and hostname (devcluster.kubelet),
and the resolver's question (dns.lookup) against a stand-in server."""

from __future__ import annotations

import socket
import struct
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.devcluster import dns, kubelet, loopbackdns
from tests.unit.devcluster.test_kubelet import needs_mount_namespaces

HOST_RESOLV = "# written by the machine\nnameserver 10.255.255.53\nsearch corp.example\n"
NODE_HOSTS = "127.0.0.1 localhost\n127.0.0.1 vm\n"
CLUSTER = kubelet.ClusterDNS(("127.53.7.9",))


def pod(name: str = "ddp-1", **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"u-{name}", "labels": {}},
        "spec": {"containers": [{"name": "main"}], **spec},
        "status": {"podIP": "127.200.0.7", "podIPs": [{"ip": "127.200.0.7"}], "phase": "Running"},
    }


def test_the_corefile_binds_the_clusters_addresses_and_reads_the_api(tmp_path: Path) -> None:
    server = dns.Server(
        ("127.53.7.9", "10.150.0.1"), tmp_path / "kubeconfig", tmp_path / "records", 4101, 4102
    )
    assert dns.corefile(server).splitlines() == [
        ".:53 {",
        "    bind 127.53.7.9 10.150.0.1",
        "    errors",
        "    health 127.0.0.1:4101",
        "    ready 127.0.0.1:4102",
        f"    hosts {tmp_path / 'records'} cluster.local {{",
        "        ttl 5",
        "        reload 1s",
        "        fallthrough",
        "    }",
        "    kubernetes cluster.local in-addr.arpa ip6.arpa {",
        f"        kubeconfig {tmp_path / 'kubeconfig'}",
        "        pods insecure",
        "        fallthrough in-addr.arpa ip6.arpa",
        "        ttl 5",
        "    }",
        "    forward . /etc/resolv.conf",
        "    loadbalance",
        "}",
    ]


def test_each_cluster_folder_gets_a_loopback_address_of_its_own(tmp_path: Path) -> None:
    first, second = dns.loopback_address(tmp_path / "a"), dns.loopback_address(tmp_path / "b")
    assert first != second
    assert first == dns.loopback_address(tmp_path / "a")  # the next `cluster up` finds it
    for address in (first, second):
        octets = [int(o) for o in address.split(".")]
        assert octets[:2] == [127, 53]  # not a kwok node (127.1-3) nor kwok's pods (127.200)
        assert 1 <= octets[3] <= 254


def test_kube_dns_is_named_as_in_a_real_cluster_and_publishes_the_address() -> None:
    service = dns.service("127.53.7.9")
    assert (service["metadata"]["namespace"], service["metadata"]["name"]) == (
        "kube-system",
        "kube-dns",
    )
    assert service["spec"]["clusterIP"] == "10.96.0.10"
    assert "selector" not in service["spec"]  # CoreDNS is no pod: its endpoint is written
    assert dns.published_address(service) == ("127.53.7.9", 53)
    assert dns.published_address({"metadata": {}}) is None
    assert dns.published_address(None) is None
    endpoints = dns.endpoint_slice("10.150.0.1")
    assert endpoints["metadata"]["labels"]["kubernetes.io/service-name"] == "kube-dns"
    assert endpoints["endpoints"][0]["addresses"] == ["10.150.0.1"]
    assert {p["name"] for p in endpoints["ports"]} == {p["name"] for p in service["spec"]["ports"]}
    role, binding = dns.rbac()
    assert binding["subjects"][0]["name"] == dns.USER
    assert {"discovery.k8s.io"} <= {g for rule in role["rules"] for g in rule["apiGroups"]}


def headless(name: str, publish: bool = False, selector: dict[str, str] | None = None) -> Any:
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"s-{name}"},
        "spec": {
            "clusterIP": "None",
            "selector": {"job": name} if selector is None else selector,
            "publishNotReadyAddresses": publish,
        },
    }


def member(name: str, job: str, ip: str, ready: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "labels": {"job": job}},
        "spec": {"hostname": name, "subdomain": job},
        "status": {
            "podIP": ip,
            "phase": extra.pop("phase", "Running"),
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
        **extra,
    }


@pytest.mark.parametrize(
    ("case", "service", "pods", "expected"),
    [
        (
            "a headless service names each pod and holds them all",
            headless("ddp"),
            [member("ddp-0", "ddp", "127.200.0.2"), member("ddp-1", "ddp", "127.200.0.3")],
            [
                "127.200.0.2\tddp-0.ddp.team.svc.cluster.local",
                "127.200.0.2\tddp.team.svc.cluster.local",
                "127.200.0.3\tddp-1.ddp.team.svc.cluster.local",
                "127.200.0.3\tddp.team.svc.cluster.local",
            ],
        ),
        (
            "a pod not ready is named only with publishNotReadyAddresses",
            headless("ddp"),
            [member("ddp-0", "ddp", "127.200.0.2", ready=False)],
            [],
        ),
        (
            "publishNotReadyAddresses names a pod not ready yet",
            headless("ddp", publish=True),
            [member("ddp-0", "ddp", "127.200.0.2", ready=False)],
            [
                "127.200.0.2\tddp-0.ddp.team.svc.cluster.local",
                "127.200.0.2\tddp.team.svc.cluster.local",
            ],
        ),
        (
            "a pod that ended is never named",
            headless("ddp", publish=True),
            [member("ddp-0", "ddp", "127.200.0.2", phase="Succeeded")],
            [],
        ),
        (
            "a pod without the service as its subdomain gets its dashed address",
            headless("web", selector={"job": "ddp"}),
            [member("ddp-0", "ddp", "127.200.0.2")],
            [
                "127.200.0.2\t127-200-0-2.web.team.svc.cluster.local",
                "127.200.0.2\tweb.team.svc.cluster.local",
            ],
        ),
        (
            "a routable address is the kubernetes plugin's, from its EndpointSlice",
            headless("ddp"),
            [member("ddp-0", "ddp", "10.150.1.4")],
            [],
        ),
        (
            "a service with a ClusterIP is the kubernetes plugin's",
            {**headless("ddp"), "spec": {"clusterIP": "10.96.3.4", "selector": {"job": "ddp"}}},
            [member("ddp-0", "ddp", "127.200.0.2")],
            [],
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and " " in value else "",
)
def test_loopback_records(
    case: str, service: dict[str, Any], pods: list[dict[str, Any]], expected: list[str]
) -> None:
    text = loopbackdns.loopback_records([service], pods)
    assert text.startswith(loopbackdns.HEADER)
    assert text.splitlines()[1:] == expected


def test_a_watch_event_updates_the_records_and_an_expired_watch_starts_over() -> None:
    mirror = loopbackdns.Mirror(api=None, records=Path("/nonexistent"))
    pod_body = {**member("ddp-0", "ddp", "127.200.0.2"), "metadata": {"uid": "p1", "name": "x"}}
    assert mirror.apply("pods", {"type": "ADDED", "object": pod_body})
    assert mirror.changed.is_set()
    assert mirror.objects["pods"]["p1"]["status"]["podIP"] == "127.200.0.2"
    assert mirror.apply("pods", {"type": "DELETED", "object": pod_body})
    assert mirror.objects["pods"] == {}
    assert mirror.apply("pods", {"type": "BOOKMARK", "object": {"metadata": {}}})
    assert not mirror.apply("pods", {"type": "ERROR", "object": {"code": 410}})


# ---- what the process kubelet writes for a pod --------------------------------------------


def test_a_cluster_first_pod_asks_the_cluster_dns_with_the_kubelets_search_path() -> None:
    assert kubelet.resolv_conf(pod(), CLUSTER, HOST_RESOLV).splitlines() == [
        "search team.svc.cluster.local svc.cluster.local cluster.local corp.example",
        "nameserver 127.53.7.9",
        "options ndots:5",
    ]


@pytest.mark.parametrize(
    ("case", "spec", "cluster", "expected"),
    [
        (
            "a host-network pod keeps the machine's resolver",
            {"hostNetwork": True},
            CLUSTER,
            ["search corp.example", "nameserver 10.255.255.53"],
        ),
        (
            "ClusterFirstWithHostNet gives a host-network pod the cluster's",
            {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"},
            CLUSTER,
            [
                "search team.svc.cluster.local svc.cluster.local cluster.local corp.example",
                "nameserver 127.53.7.9",
                "options ndots:5",
            ],
        ),
        (
            "Default is the machine's resolver",
            {"dnsPolicy": "Default"},
            CLUSTER,
            ["search corp.example", "nameserver 10.255.255.53"],
        ),
        (
            "without cluster DNS ClusterFirst falls back to the machine's",
            {},
            kubelet.ClusterDNS(()),
            ["search corp.example", "nameserver 10.255.255.53"],
        ),
        (
            "None takes only dnsConfig, whose options merge by name",
            {
                "dnsPolicy": "None",
                "dnsConfig": {
                    "nameservers": ["127.0.0.9"],
                    "searches": ["a.example"],
                    "options": [{"name": "ndots", "value": "2"}, {"name": "edns0"}],
                },
            },
            CLUSTER,
            ["search a.example", "nameserver 127.0.0.9", "options ndots:2 edns0"],
        ),
        (
            "dnsConfig adds to ClusterFirst and overrides its ndots",
            {"dnsConfig": {"options": [{"name": "ndots", "value": "1"}]}},
            CLUSTER,
            [
                "search team.svc.cluster.local svc.cluster.local cluster.local corp.example",
                "nameserver 127.53.7.9",
                "options ndots:1",
            ],
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and " " in value else "",
)
def test_dns_policies(
    case: str, spec: dict[str, Any], cluster: kubelet.ClusterDNS, expected: list[str]
) -> None:
    assert kubelet.resolv_conf(pod(**spec), cluster, HOST_RESOLV).splitlines() == expected


def test_the_hosts_file_is_the_kubelets_with_the_pods_own_name() -> None:
    named = pod(hostname="ddp-1", subdomain="ddp", hostAliases=[
        {"ip": "127.0.0.5", "hostnames": ["cache", "cache.local"]}
    ])  # fmt: skip
    assert kubelet.hosts_file(named, NODE_HOSTS).splitlines() == [
        "# Kubernetes-managed hosts file.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
        "127.200.0.7\tddp-1.ddp.team.svc.cluster.local\tddp-1",
        "",
        "# Entries added by HostAliases.",
        "127.0.0.5\tcache\tcache.local",
    ]
    plain = kubelet.hosts_file(pod("web-7"), NODE_HOSTS).splitlines()
    assert plain[-1] == "127.200.0.7\tweb-7"
    assert kubelet.hosts_file(pod(hostNetwork=True), NODE_HOSTS) == NODE_HOSTS


def test_the_hostname_is_the_kubelets() -> None:
    assert kubelet.hostname(pod(hostname="ddp-1", subdomain="ddp")) == (
        "ddp-1",
        "ddp.team.svc.cluster.local",
    )
    assert kubelet.hostname(pod("x" * 62 + "-abc")) == ("x" * 62, "")  # 63, no trailing -
    assert kubelet.uts_hostname(pod(hostname="ddp-1")) == "ddp-1"
    fqdn = pod(hostname="ddp-1", subdomain="ddp", setHostnameAsFQDN=True)
    assert kubelet.uts_hostname(fqdn) == "ddp-1.ddp.team.svc.cluster.local"
    assert kubelet.uts_hostname(pod(hostNetwork=True)) is None


def test_the_launcher_binds_files_over_the_machines_and_sets_the_hostname(
    tmp_path: Path,
) -> None:
    needs_mount_namespaces()
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.53.7.9\n")
    missing = tmp_path / "nowhere" / "file.conf"  # a file target that does not exist yet
    argv = kubelet.launcher(
        [
            kubelet.Mount(str(resolv), "/etc/resolv.conf", file=True),
            kubelet.Mount(str(resolv), str(missing), read_only=True, file=True),
        ],
        ["sh", "-c", f"cat /etc/resolv.conf {missing}; hostname"],
        hostname="ddp-1",
    )
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["nameserver 127.53.7.9", "nameserver 127.53.7.9", "ddp-1"]
    assert "127.53.7.9" not in Path("/etc/resolv.conf").read_text()  # the machine's is kept
    assert socket.gethostname() != "ddp-1"


# ---- the resolver's question -----------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[tuple[int, list[bytes]]]:
    """A one-question DNS server on 127.0.0.1 answering two A records, the second through a
    compression pointer, after a stray datagram with another id."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    asked: list[bytes] = []

    def answer() -> None:
        data, peer = sock.recvfrom(512)
        asked.append(data)
        ident = struct.unpack(">H", data[:2])[0]
        question = data[12:]
        head = struct.pack(">HHHHHH", ident, 0x8180, 1, 2, 0, 0)
        first = question[:-4] + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton("127.200.0.3")
        second = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton("127.200.0.2")
        stray = struct.pack(">HHHHHH", ident ^ 1, 0x8183, 1, 0, 0, 0) + question
        sock.sendto(stray, peer)
        sock.sendto(head + question + first + second, peer)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield sock.getsockname()[1], asked
    thread.join(timeout=5)
    sock.close()


def test_lookup_reads_every_address_of_the_answer(server: tuple[int, list[bytes]]) -> None:
    port, asked = server
    code, addresses = dns.lookup("ddp.team.svc.cluster.local", "127.0.0.1", port)
    assert (code, addresses) == (0, ["127.200.0.2", "127.200.0.3"])
    assert b"\x03ddp\x04team\x03svc\x07cluster\x05local\x00\x00\x01\x00\x01" in asked[0]
