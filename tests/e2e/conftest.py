"""The end-to-end suite: the chart installed by ``helm install`` into a local control plane of
its own, its operator and checkpoint daemons run by ``matrixpool sim --daemons chart`` as the
process kubelet of the simulated nodes (tests/integration/chart.py). Nothing here starts the
operator or a daemon by hand. The sim stands in for the matrixpool image, which carries torch: it
runs from .venv-torch (tools/torch-venv.sh; `make e2e` makes it) where there is one, so a pod's
``torchrun`` is found as in the image."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from matrixpool.devcluster import topology
from tests.integration import chart, framework
from tests.integration.conftest import namespace  # noqa: F401 -- a fixture of this suite too

SHAPE = topology.Shape(supernodes=2, nodes_per_supernode=8, nodes_per_rack=4)
TORCH_PYTHON = Path(__file__).parents[2] / ".venv-torch" / "bin" / "python"
DEVICE_PLUGIN = ("devicePlugin.enabled=true",)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[framework.TestCluster]:
    """2 supernodes of 8 nodes; the CRDs come from the chart."""
    yield from chart.own_cluster(tmp_path_factory.mktemp("cluster"), SHAPE)


@pytest.fixture(scope="session")
def installed(
    cluster: framework.TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[chart.Installed]:
    """The chart installed with charts/matrixpool/ci/local-values.yaml and the device plugin's
    DaemonSet, the sim running its pods. The sim's nodes have no kubelet device-plugins folder:
    the plugin's pods wait for their hostPath (FailedMount) and run no process, but they are
    there to bind the plugin's tokens to (its ServiceAccount and policy)."""
    python = str(TORCH_PYTHON) if TORCH_PYTHON.exists() else sys.executable
    folder = tmp_path_factory.mktemp("sim") / "sim"
    yield from chart.installed_for_session(cluster, folder, python=python, sets=DEVICE_PLUGIN)
