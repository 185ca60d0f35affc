"""Fixtures of the integration and chaos tests: one real control plane per session, a fresh
namespace per test, the operator as a subprocess. See :mod:`tests.integration.framework`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from matrixpool.devcluster import topology
from tests.integration import framework, manifests


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[framework.TestCluster]:
    """The session's control plane: 2 supernodes of 48 nodes × 8 cards, 4 nodes per rack
    (MATRIXPOOL_TEST_SUPERNODES changes the supernode count). Failing to start fails."""
    shape = topology.Shape(supernodes=int(os.environ.get("MATRIXPOOL_TEST_SUPERNODES", "2")))
    folder = tmp_path_factory.mktemp("cluster")
    test_cluster = framework.start_cluster(folder, shape)
    try:
        yield test_cluster
    finally:
        if not os.environ.get("MATRIXPOOL_KEEP_CLUSTER"):
            test_cluster.local.down()


@pytest.fixture
def namespace(cluster: framework.TestCluster) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = framework.unique("t")
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def operator(cluster: framework.TestCluster, tmp_path: Path) -> Iterator[framework.Operator]:
    """The operator running against the session's cluster; its log is printed on failure."""
    process = framework.Operator(cluster, tmp_path / "operator.log").start()
    try:
        yield process
    finally:
        process.kill()
        print(process.log()[-20000:])


@pytest.fixture
def two_supernodes(cluster: framework.TestCluster) -> Iterator[list[str]]:
    """sn-0 and sn-1, one spare node each, over a cluster with no gang pods left."""
    framework.eventually(
        lambda: not framework.gang_pods(cluster), timeout=60, what="no gang pods left"
    )
    names = ["sn-0", "sn-1"][: cluster.shape.supernodes]
    for name in names:
        cluster.kubectl("apply", "-f", "-", input=manifests.supernode(name).yaml())
    yield names
    for name in names:
        cluster.kubectl("delete", "supernode", name, check=False)


TWO_RACKS = ("sn-0-rack-0", "sn-0-rack-1")  # the racks of small_supernode


@pytest.fixture
def small_supernode(cluster: framework.TestCluster) -> Iterator[str]:
    """SuperNode sn-pre: the 8 nodes of two racks of sn-0 (:data:`TWO_RACKS`), no spare, over a
    cluster with no gang pods left; deleted after the test."""
    framework.eventually(
        lambda: not framework.gang_pods(cluster), timeout=60, what="no gang pods left"
    )
    body = manifests.supernode("sn-pre", spares=0).body
    body["spec"]["nodeSelector"] = {
        "matchExpressions": [
            {"key": "matrixpool.dev/rack", "operator": "In", "values": list(TWO_RACKS)}
        ]
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    yield "sn-pre"
    cluster.kubectl("delete", "supernode", "sn-pre", check=False)
