"""Fixtures of the chaos tests: the integration tests' control plane (one per session), plus
``matrixpool sim`` over every supernode, the operator told the daemons' token, and a sampler
that checks, several times a second, that no card is held by two pods."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import framework
from tests.integration.conftest import cluster, namespace, two_supernodes

__all__ = ["cluster", "namespace", "two_supernodes"]

CARDS = "matrixpool.dev/cards"
RESERVED = "matrixpool.dev/node"


@pytest.fixture(scope="session")
def sim(
    cluster: framework.TestCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[framework.Sim]:
    """One sim for the session: a daemon per node of every supernode (faults restart them)."""
    persistent = tmp_path_factory.getbasetemp() / "persistent"  # jobs' tier 3 (start_job)
    process = framework.Sim(
        cluster, tmp_path_factory.mktemp("sim") / "sim", persistent_root=persistent
    ).start()
    try:
        yield process
    finally:
        process.stop()
        print(process.log()[-3000:])


@pytest.fixture
def operator(
    cluster: framework.TestCluster, tmp_path: Path, sim: framework.Sim
) -> Iterator[framework.Operator]:
    env = sim.operator_env()
    process = framework.Operator(cluster, tmp_path / "operator.log", env=env).start()
    try:
        yield process
    finally:
        process.kill()
        print(process.log()[-20000:])


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
