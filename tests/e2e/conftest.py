"""The end-to-end suite: the chart installed by ``helm install`` into a local control plane of
its own, its operator and checkpoint daemons run by ``matrixpool sim --daemons chart`` as the
process kubelet of the simulated nodes. Nothing here starts the operator or a daemon by hand."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from matrixpool.devcluster import cluster as devcluster
from matrixpool.devcluster import topology
from tests.integration import framework
from tests.integration.conftest import namespace  # noqa: F401 -- a fixture of this suite too

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "matrixpool"
VALUES = Path(__file__).with_name("values-local.yaml")
RELEASE = "matrixpool"  # the release the local cluster's pod-annotations policy was rendered for
SYSTEM = "matrixpool-system"
SHARED = "/var/lib/matrixpool/persistent"  # the chart's persistentPath: shared by every node
SHAPE = topology.Shape(supernodes=2, nodes_per_supernode=8, nodes_per_rack=4)


@dataclass
class Installed:
    """The chart's release on the cluster, and the sim that runs its pods."""

    cluster: framework.TestCluster
    sim: framework.Sim
    ports: dict[str, int]

    def pods(self, component: str | None = None) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/instance={RELEASE}"
        if component:
            selector += f",app.kubernetes.io/component={component}"
        out = self.cluster.kubectl("get", "pods", "-n", SYSTEM, "-l", selector, "-o", "json")
        return list(json.loads(out.stdout)["items"])

    def operator_pod(self) -> dict[str, Any]:
        found = [p for p in self.pods() if p["metadata"]["name"].startswith(f"{RELEASE}-")]
        found = [p for p in found if "checkpoint" not in p["metadata"]["name"]]
        assert len(found) == 1, [p["metadata"]["name"] for p in found]
        return found[0]

    def log_of(self, pod: dict[str, Any], container: str | None = None) -> str:
        """What a container the sim runs printed (its log file in the sim's folder)."""
        meta = pod["metadata"]
        suffix = f".{container}" if container else ""
        path = (
            self.sim.folder
            / "trainers"
            / f"{pod['spec']['nodeName']}.{meta['namespace']}.{meta['name']}{suffix}.log"
        )
        return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[framework.TestCluster]:
    """A control plane of its own: 2 supernodes of 8 nodes; the CRDs come from the chart."""
    folder = tmp_path_factory.mktemp("cluster")
    local = devcluster.Cluster(
        folder, progress=lambda line: print(line, file=sys.stderr), tied=True
    )
    local.up(SHAPE)
    test_cluster = framework.TestCluster(local=local, shape=SHAPE)
    try:
        yield test_cluster
    finally:
        if not os.environ.get("MATRIXPOOL_KEEP_CLUSTER"):
            local.down()


@pytest.fixture(scope="session")
def installed(
    cluster: framework.TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Installed]:
    """``helm install matrixpool charts/matrixpool -n matrixpool-system -f values-local.yaml``
    (ports picked free, since other clusters may run on this machine), then the sim as the
    nodes' kubelet; yields once every node's daemon announced itself and the operator runs."""
    daemon, metrics, health = devcluster.free_ports(3)
    ports = {"daemon": daemon, "metrics": metrics, "health": health}
    cluster.kubectl("create", "namespace", SYSTEM)
    cluster.helm(
        "install",
        RELEASE,
        str(CHART),
        "-n",
        SYSTEM,
        "-f",
        str(VALUES),
        "--set",
        f"checkpointDaemon.port={daemon},metrics.port={metrics},operator.healthPort={health}",
    )
    sim = framework.Sim(
        cluster,
        tmp_path_factory.mktemp("sim") / "sim",
        port=daemon,
        daemons="chart",
        shared_paths=(SHARED,),
    ).start()
    release = Installed(cluster, sim, ports)
    try:
        framework.eventually(
            lambda: len(framework.daemon_endpoints(cluster, SYSTEM)) == SHAPE.node_count,
            timeout=240,
            what="every node's checkpoint daemon announced by the chart's DaemonSet",
        )
        framework.eventually(
            lambda: "main loop started" in release.log_of(release.operator_pod()),
            timeout=120,
            what="the chart's operator running",
        )
        yield release
    finally:
        sim.stop()
        print(sim.log()[-5000:])
        try:
            print(release.log_of(release.operator_pod())[-20000:])
        except Exception as error:  # the pod may be gone
            print(f"no operator log: {error}")
