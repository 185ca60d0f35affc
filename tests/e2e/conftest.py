"""The end-to-end suite: the chart installed by ``helm install`` into a local control plane of
its own, its operator and checkpoint daemons run by ``matrixpool sim --daemons chart`` as the
process kubelet of the simulated nodes (tests/integration/chart.py). Nothing here starts the
operator or a daemon by hand."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from matrixpool.devcluster import cluster as devcluster
from matrixpool.devcluster import topology
from tests.integration import chart, framework
from tests.integration.conftest import namespace  # noqa: F401 -- a fixture of this suite too

SHAPE = topology.Shape(supernodes=2, nodes_per_supernode=8, nodes_per_rack=4)


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
) -> Iterator[chart.Installed]:
    """The chart installed with charts/matrixpool/ci/local-values.yaml, the sim running its pods."""
    release = chart.install(cluster, tmp_path_factory.mktemp("sim") / "sim", SHAPE.node_count)
    try:
        yield release
    finally:
        release.sim.stop()
        print(release.sim.log()[-5000:])
        print(release.operator_log()[-20000:])
