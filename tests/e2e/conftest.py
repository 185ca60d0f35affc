"""The end-to-end suite: the chart installed by ``helm install`` into a local control plane of
its own, its operator and checkpoint daemons run by ``matrixpool sim --daemons chart`` as the
process kubelet of the simulated nodes (tests/integration/chart.py). Nothing here starts the
operator or a daemon by hand."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from matrixpool.devcluster import topology
from tests.integration import chart, framework
from tests.integration.conftest import namespace  # noqa: F401 -- a fixture of this suite too

SHAPE = topology.Shape(supernodes=2, nodes_per_supernode=8, nodes_per_rack=4)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[framework.TestCluster]:
    """2 supernodes of 8 nodes; the CRDs come from the chart."""
    yield from chart.own_cluster(tmp_path_factory.mktemp("cluster"), SHAPE)


@pytest.fixture(scope="session")
def installed(
    cluster: framework.TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[chart.Installed]:
    """The chart installed with charts/matrixpool/ci/local-values.yaml, the sim running its pods."""
    yield from chart.installed_for_session(cluster, tmp_path_factory.mktemp("sim") / "sim")
