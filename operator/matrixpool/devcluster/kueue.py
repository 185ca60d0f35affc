"""Kueue beside the local control plane, as a peer to measure matrixpool against
(``matrixpool cluster up --peers``; benchmarks/peers.py).

Kueue v0.17 (Topology Aware Scheduling) is built from its Go module by ``tools/k8s/kueue.sh``
into ``~/.cache/matrixpool/peers/kueue-<version>/`` with the CRDs and webhook manifest of the same
version. Here it runs as a plain process: its webhooks serve on loopback with the cluster's
server certificate, and the webhook configurations point at that URL (no Service, no Pod).

The pure parts — the manager's Configuration, the rewritten webhooks and the queue objects (a
Topology supernode → rack → hostname, one ResourceFlavor, one ClusterQueue holding every card)
— are functions of their inputs, tested without a cluster (tests/unit/devcluster/test_kueue.py).
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from matrixpool.api import labels
from matrixpool.devcluster import binaries, topology
from matrixpool.devcluster import certs as certs_module

API = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
TOPOLOGY = "matrixpool"
FLAVOR = "kwok-cards"
CLUSTER_QUEUE = "bench"
# Kueue's manager, with internal certificate management off, always watches this pair (its
# metrics certificate), even with metrics off; it exits if the files are missing.
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
# The webhooks kept from upstream's manifest: the objects a Job gang and its queues use. The
# others (pods, JobSets, RayJobs, ...) would intercept objects this cluster never gives Kueue.
WEBHOOKS = frozenset(
    {
        "mjob.kb.io",
        "vjob.kb.io",
        "mworkload.kb.io",
        "vworkload.kb.io",
        "mclusterqueue.kb.io",
        "vclusterqueue.kb.io",
        "mresourceflavor.kb.io",
        "vresourceflavor.kb.io",
        "vcohort.kb.io",
    }
)


class KueueError(RuntimeError):
    """Kueue could not be built, configured or started."""


def build(progress: Callable[[str], None]) -> Path:
    """Build (or reuse) Kueue; the folder with ``kueue``, ``crd/`` and ``webhook/``."""
    script = binaries.repo_root() / "tools" / "k8s" / "kueue.sh"
    with subprocess.Popen(
        ["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        assert process.stderr is not None
        assert process.stdout is not None
        for line in process.stderr:
            progress(line.rstrip())
        out = process.stdout.read().strip().splitlines()
        code = process.wait()
    if code != 0 or not out:
        raise KueueError(f"tools/k8s/kueue.sh failed (exit {code})")
    return Path(out[-1])


def configuration(webhook_port: int, health_port: int, cert_dir: Path) -> dict[str, Any]:
    """The manager's Configuration: loopback only, no leader election, no internal certificates,
    Jobs with a queue label only, TAS on, the extra API servers off."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "clientConnection": {"qps": 500, "burst": 1000},
        "integrations": {"frameworks": ["batch/job"]},
        "featureGates": {
            "TopologyAwareScheduling": True,
            "VisibilityOnDemand": False,
            "MultiKueue": False,
        },
    }


def webhooks(
    documents: Iterable[Mapping[str, Any]], port: int, ca_pem: bytes
) -> list[dict[str, Any]]:
    """Upstream's webhook configurations, kept to :data:`WEBHOOKS`, each pointing at
    ``https://127.0.0.1:<port><path>`` with the cluster CA; Job webhooks see only Jobs that name
    a queue, so no other Job waits on Kueue."""
    bundle = base64.b64encode(ca_pem).decode()
    configurations = []
    for document in documents:
        if not document:
            continue
        kept = []
        for hook in document.get("webhooks", []):
            if hook["name"] not in WEBHOOKS:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook = {
                **hook,
                "clientConfig": {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle},
                "timeoutSeconds": 10,
            }
            if hook["name"] in ("mjob.kb.io", "vjob.kb.io"):
                hook["objectSelector"] = {
                    "matchExpressions": [{"key": QUEUE_LABEL, "operator": "Exists"}]
                }
            kept.append(hook)
        metadata = {"name": "kueue-" + document["metadata"]["name"]}
        configurations.append({**document, "metadata": metadata, "webhooks": kept})
    return configurations


def queue_objects(shape: topology.Shape) -> list[dict[str, Any]]:
    """Topology (supernode → rack → hostname), the flavor of the kwok nodes, one ClusterQueue
    whose quota is every card of the shape (preempting lower priorities), and two priorities."""
    cards = shape.node_count * shape.cards_per_node
    return [
        {
            "apiVersion": API,
            "kind": "Topology",
            "metadata": {"name": TOPOLOGY},
            "spec": {
                "levels": [
                    {"nodeLabel": labels.SUPERNODE},
                    {"nodeLabel": labels.RACK},
                    {"nodeLabel": "kubernetes.io/hostname"},
                ]
            },
        },
        {
            "apiVersion": API,
            "kind": "ResourceFlavor",
            "metadata": {"name": FLAVOR},
            "spec": {"nodeLabels": {"type": "kwok"}, "topologyName": TOPOLOGY},
        },
        {
            "apiVersion": API,
            "kind": "ClusterQueue",
            "metadata": {"name": CLUSTER_QUEUE},
            "spec": {
                "namespaceSelector": {},
                "queueingStrategy": "BestEffortFIFO",
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [
                    {
                        "coveredResources": [shape.card_resource],
                        "flavors": [
                            {
                                "name": FLAVOR,
                                "resources": [
                                    {"name": shape.card_resource, "nominalQuota": str(cards)}
                                ],
                            }
                        ],
                    }
                ],
            },
        },
        *(
            {
                "apiVersion": API,
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": name},
                "value": value,
            }
            for name, value in (("bench-low", 100), ("bench-high", 1000))
        ),
    ]


def local_queue(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": API,
        "kind": "LocalQueue",
        "metadata": {"name": CLUSTER_QUEUE, "namespace": namespace},
        "spec": {"clusterQueue": CLUSTER_QUEUE},
    }


def write_files(
    folder: Path, built: Path, ports: tuple[int, int], pki: certs_module.PKI
) -> tuple[Path, Path]:
    """Certificates, the Configuration and the webhook configurations under ``folder``;
    (config file, webhooks file)."""
    webhook_port, health_port = ports
    certs = folder / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    for target in (certs, METRICS_CERTS):
        try:
            target.mkdir(parents=True, exist_ok=True)
            (target / "tls.crt").write_bytes(Path(pki.server_cert).read_bytes())
            (target / "tls.key").write_bytes(Path(pki.server_key).read_bytes())
        except PermissionError as error:
            raise KueueError(
                f"Kueue's manager needs a certificate pair at {target} (hard-coded for its "
                f"metrics server, even when off): {error}; run as root"
            ) from error
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump(configuration(webhook_port, health_port, certs)))
    manifest = yaml.safe_load_all((built / "webhook" / "manifests.yaml").read_text())
    rewritten = webhooks(manifest, webhook_port, Path(pki.ca_cert).read_bytes())
    hooks = folder / "webhooks.yaml"
    hooks.write_text(yaml.safe_dump_all(rewritten, sort_keys=False))
    return config, hooks
