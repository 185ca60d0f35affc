"""Fixtures of the chaos tests: a control plane of their own (one per session) with the chart
installed by ``helm install`` — its operator and checkpoint daemons run by ``matrixpool sim
--daemons chart`` as the process kubelet of every node (tests/integration/chart.py) — and a
sampler that checks, several times a second, that no card is held by two pods."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from matrixpool.devcluster import topology
from tests.integration import chart, framework
from tests.integration.conftest import namespace, two_supernodes

__all__ = ["namespace", "two_supernodes"]

CARDS = "matrixpool.dev/cards"
RESERVED = "matrixpool.dev/node"
# 2 supernodes of 16 nodes × 8 cards, 4 nodes per rack: every chaos scenario fits (8 ranks and
# spares), with 32 daemons rather than 96.
SHAPE = topology.Shape(supernodes=2, nodes_per_supernode=16, nodes_per_rack=4)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[framework.TestCluster]:
    """The session's control plane; the CRDs come from the chart."""
    yield from chart.own_cluster(tmp_path_factory.mktemp("cluster"), SHAPE)


@pytest.fixture(scope="session")
def installed(
    cluster: framework.TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[chart.Installed]:
    """The chart, installed once for the session; its pods run under the sim. Its operator
    runs on sn-1's last node, which no fault takes down (they hit sn-0's nodes)."""
    last = topology.node_name(1, SHAPE.nodes_per_supernode - 1)
    folder = tmp_path_factory.mktemp("sim") / "sim"
    yield from chart.installed_for_session(cluster, folder, operator_node=last)


@pytest.fixture(scope="session")
def sim(installed: chart.Installed) -> framework.Sim:
    """The process kubelet of every node (trainer logs and pids are in its folder)."""
    return installed.sim


@pytest.fixture
def operator(installed: chart.Installed) -> Iterator[chart.Installed]:
    """The chart's operator, running; its log's tail is printed after the test."""
    if installed.extra_env:  # a test changed its env: back to the chart's defaults
        installed.set_operator_env({})
    framework.eventually(installed.operator_running, timeout=60, what="the chart's operator")
    yield installed
    print(installed.operator_log()[-20000:])


class CardSampler:
    """Lists the gang pods every ``period`` seconds and records any (node, card) held by two
    pods at once; a terminating or failed pod still holds its cards until it is gone, a pod
    that Succeeded holds none (its container exited, as a device plugin sees it)."""

    def __init__(self, cluster: framework.TestCluster, period: float = 0.3) -> None:
        self.api = cluster.api
        self.period = period
        self.samples = 0
        self.clashes: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                items = self.api.core.list_pod_for_all_namespaces(
                    label_selector="matrixpool.dev/job"
                ).items
            except Exception:  # the API server restarting (chaos): sample again later
                continue
            self.check(items)

    def check(self, items: list[Any]) -> None:
        holder: dict[tuple[str, int], str] = {}
        for pod in items:
            if pod.status is not None and pod.status.phase == "Succeeded":
                continue
            annotations = pod.metadata.annotations or {}
            node = pod.spec.node_name or annotations.get(RESERVED)
            cards = [int(c) for c in annotations.get(CARDS, "").split(",") if c.strip()]
            for card in cards if node else []:
                key = (node, card)
                name = f"{pod.metadata.namespace}/{pod.metadata.name}"
                if key in holder and holder[key] != name:
                    self.clashes.append(f"{node} card {card}: {holder[key]} and {name}")
                holder[key] = name
        self.samples += 1

    def __enter__(self) -> CardSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture
def cards(cluster: framework.TestCluster) -> Iterator[CardSampler]:
    with CardSampler(cluster) as sampler:
        yield sampler
    assert sampler.samples > 0, "the card sampler never sampled"
    assert not sampler.clashes, f"cards held twice: {sampler.clashes[:5]}"
