"""The real-node suite: `matrixpool cluster up --real-nodes 3` (kubelets with containerd and
runc, in network and mount namespaces of their own), the image built here by `make image`
(tools/image/build.sh) and loaded into every node, and the chart installed by `helm install`
with charts/matrixpool/ci/real-nodes-values.yaml. The operator, its daemons, the device plugin
and the trainers run in real containers. Needs root; under CI a refusal is a failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from matrixpool.devcluster import cluster as devcluster
from matrixpool.devcluster import realnodes, topology
from tests import ci
from tests.integration import framework
from tests.integration.chart import CHART, RELEASE, REPO, SYSTEM
from tests.integration.conftest import namespace  # noqa: F401 -- a fixture of this suite too

# Two kwok nodes beside three real ones: the real ones form SuperNode sn-real (2 racks of 2).
SHAPE = topology.Shape(supernodes=1, nodes_per_supernode=2, cards_per_node=8, nodes_per_rack=2)
REAL_NODES = 3
REAL_SUPERNODE = "sn-real"
VALUES = CHART / "ci" / "real-nodes-values.yaml"
IMAGE = "matrixpool:dev"


def _require_root() -> None:
    try:
        realnodes.require_root()
    except realnodes.RealNodeError as error:
        ci.cannot_run(f"real nodes cannot run: {error}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[framework.TestCluster]:
    """The control plane with 2 kwok nodes and 3 real nodes, no CRDs (the chart has them)."""
    _require_root()
    local = devcluster.Cluster(
        tmp_path_factory.mktemp("cluster"),
        progress=lambda line: print(line, file=sys.stderr),
        tied=True,
    )
    local.up(SHAPE, real_nodes=REAL_NODES, real_supernode=REAL_SUPERNODE)
    try:
        yield framework.TestCluster(local=local, shape=SHAPE)
    finally:
        if not os.environ.get("MATRIXPOOL_KEEP_CLUSTER"):
            local.down()


@pytest.fixture(scope="session")
def image(cluster: framework.TestCluster) -> str:
    """`make image`: the image built from Debian packages and the wheel, loaded into every node."""
    built = subprocess.run(
        [str(REPO / "tools" / "image" / "build.sh"), IMAGE],
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    cluster.local.load_image(Path(built.stdout.strip().splitlines()[-1]))
    return IMAGE


@pytest.fixture(scope="session")
def installed(cluster: framework.TestCluster, image: str) -> Iterator[framework.TestCluster]:
    """`helm install matrixpool charts/matrixpool -f charts/matrixpool/ci/real-nodes-values.yaml`;
    returns once the operator and a daemon on every real node run, and the nodes show cards."""
    cluster.kubectl("create", "namespace", SYSTEM)
    cluster.helm("install", RELEASE, str(CHART), "-n", SYSTEM, "-f", str(VALUES))
    framework.eventually(
        lambda: running(cluster, "operator"), timeout=180, what="the operator pod running"
    )
    framework.eventually(
        lambda: len(running(cluster, "checkpoint-daemon")) == REAL_NODES,
        timeout=180,
        what="a running checkpoint daemon pod on every real node",
    )
    try:
        yield cluster
    finally:
        for pod in pods(cluster):
            for status in pod["status"].get("containerStatuses", []):
                logs = cluster.kubectl(
                    "logs",
                    "-n",
                    SYSTEM,
                    pod["metadata"]["name"],
                    "-c",
                    status["name"],
                    "--tail=60",
                    check=False,
                )
                print(f"--- {pod['metadata']['name']}/{status['name']}\n{logs.stdout}")


def pods(cluster: framework.TestCluster, component: str | None = None) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={RELEASE}"
    if component:
        selector += f",app.kubernetes.io/component={component}"
    out = cluster.kubectl("get", "pods", "-n", SYSTEM, "-l", selector, "-o", "json")
    return list(json.loads(out.stdout)["items"])


def running(cluster: framework.TestCluster, component: str) -> list[dict[str, Any]]:
    """Pods of ``component`` whose every container runs and is ready."""
    found = []
    for pod in pods(cluster, component):
        statuses = pod["status"].get("containerStatuses") or []
        if statuses and all(s.get("ready") and "running" in s.get("state", {}) for s in statuses):
            found.append(pod)
    return found
